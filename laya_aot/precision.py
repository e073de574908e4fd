"""laya's precision policy, written down: the dtype laya serves a checkpoint in, on a given device.

laya 0.4.15 (`laya.agent.Agent.__init__`, `laya.common.amp_dtype`):
- CUDA: autocast is always on. Below compute capability 8.0 it is fp16, whatever the checkpoint says.
  From 8.0 on it is `LAYA_CUDA_AMP` when set (fp16|float16|bf16|bfloat16), else the checkpoint's
  `amp_dtype`, where only the exact string "bf16" means bf16: absent, "fp16" or anything else is fp16.
- CPU: fp32, or bf16 when `LAYA_CPU_AMP` is bf16|bfloat16.

A bundle is built in that dtype (`target.dtypes` builds more), and the loader installs only an
artifact computing in the dtype the agent actually serves in (`laya_internals.serving_dtype`).
`tests/shared/test_precision.py` checks this module against laya's own functions.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence

from .dtypes import NAMES as DTYPES
from .dtypes import canonical

# the spellings laya takes in LAYA_CUDA_AMP (its own list: "half" or "fp32" there leave the checkpoint's choice)
_LAYA_CUDA_AMP = ("fp16", "float16", "bf16", "bfloat16")


def _arch_major(arch: Optional[str]) -> Optional[int]:
    """`sm_90a` -> 9; None when unknown."""
    if not arch:
        return None
    digits = "".join(c for c in arch.split("_")[-1] if c.isdigit())
    return int(digits[:-1]) if len(digits) >= 2 else None


def cuda_dtype(amp_dtype: Optional[str], arch: Optional[str] = None, env: Optional[str] = None) -> str:
    """What laya serves in on a CUDA GPU of `arch` (None: 8.0 or newer), with LAYA_CUDA_AMP=`env`."""
    major = _arch_major(arch)
    if major is not None and major < 8:
        return "fp16"
    spelled = (env or "").strip().lower()
    if spelled in _LAYA_CUDA_AMP:
        return str(canonical(spelled))
    return "bf16" if amp_dtype == "bf16" else "fp16"


def cpu_dtype(env: Optional[str] = None) -> str:
    """What laya serves in on the CPU with LAYA_CPU_AMP=`env`."""
    return "bf16" if (env or "").strip().lower() in ("bf16", "bfloat16") else "fp32"


def expected_serving_dtype(rl_config: Dict[str, Any], device: str, arch: Optional[str] = None) -> str:
    """The dtype `laya.load(..., device=device)` will serve in here (this process's environment)."""
    if device.startswith("cuda"):
        return cuda_dtype(rl_config.get("amp_dtype"), arch, os.environ.get("LAYA_CUDA_AMP"))
    return cpu_dtype(os.environ.get("LAYA_CPU_AMP"))


def build_dtypes(device: str, arch: Optional[str], rl_config: Dict[str, Any], asked: Sequence[str]) -> List[str]:
    """The dtypes a build makes artifacts in: `asked` (target.dtypes) when given, else laya's policy for
    this checkpoint on the target (the environment of the build machine does not count: the service's
    does, and it can only be known at load)."""
    if asked:
        unknown = [d for d in asked if d not in DTYPES]
        if unknown:
            raise ValueError("target.dtypes=%s: %s is not a dtype; use fp32, bf16 or fp16"
                             % (list(asked), ", ".join(unknown)))
        if device == "cuda" and "fp32" in asked:
            raise ValueError("target.dtypes=%s: laya never serves fp32 on CUDA (autocast is always on there), so "
                             "an fp32 CUDA artifact would never be installed; use bf16 and/or fp16" % list(asked))
        if device == "cpu" and "fp16" in asked:
            raise ValueError("target.dtypes=%s: laya never serves fp16 on the CPU (LAYA_CPU_AMP takes bf16 only), so "
                             "an fp16 CPU artifact would never be installed; use fp32 and/or bf16" % list(asked))
        return list(dict.fromkeys(asked))
    if device == "cuda":
        return [cuda_dtype(rl_config.get("amp_dtype"), arch)]
    return ["fp32"]


def why_not(artifact_dtype: str, serving: str, device: str) -> Optional[str]:
    """Why an artifact computing in `artifact_dtype` must not serve an agent serving in `serving`."""
    if artifact_dtype == serving:
        return None
    knob = ("the checkpoint's amp_dtype (absent means fp16) or LAYA_CUDA_AMP" if device == "cuda"
            else "LAYA_CPU_AMP")
    return ("it computes in %s and this agent serves in %s (laya's choice from %s): its answers would not be "
            "laya's; build the bundle with target.dtypes=[%s]" % (artifact_dtype, serving, knob, serving))

"""laya's precision policy, written down: the dtype laya serves a checkpoint in, on a given device.

laya 0.4.15 (`laya.agent.Agent.__init__`, `laya.common.amp_dtype`):
- CUDA: autocast is always on. Below compute capability 8.0 it is fp16, whatever the checkpoint says.
  From 8.0 on it is `LAYA_CUDA_AMP` when set (fp16|float16|bf16|bfloat16), else the checkpoint's
  `amp_dtype`, where only the exact string "bf16" means bf16: absent, "fp16" or anything else is fp16.
- CPU: fp32, or bf16 when `LAYA_CPU_AMP` is bf16|bfloat16.

A bundle is built in that dtype (`target.dtypes` builds more), and the loader installs only an
artifact built for the dtype the agent actually serves in (`laya_internals.serving_dtype`, `why_not`).
`tests/numerics/test_precision.py` checks this module against laya's own functions.

How a 16-bit artifact computes is the build's `export.precision` (`laya_aot.modeling.model`): "laya" as laya serves
(autocast in that dtype), or "faithful", fp32 but for the matrix products, whose dtype `gemm_dtype` chooses per
checkpoint from measured activations: fp16 (three more significant bits than bf16) where the largest |input| and
|output| of every product on the verify suite's cases, in fp32, stay below fp16's largest value divided by
`export.fp16_headroom`; else bf16, which never overflows, with the reason recorded. An artifact whose products
run in the other 16-bit dtype than its agent's is that deliberate choice, verified against laya's eager forward in
the agent's dtype like any other (`why_not`).
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .dtypes import NAMES as DTYPES
from .dtypes import canonical

# export.precision: how a 16-bit artifact computes (laya_aot.modeling.model)
POLICIES = ("faithful", "laya")
FP16_MAX = 65504.0  # the largest finite fp16

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


def check_policy(policy: str, headroom: float) -> None:
    """export.precision and export.fp16_headroom as the build reads them: one ValueError naming the setting."""
    if policy not in POLICIES:
        raise ValueError("export.precision=%r: one of %s" % (policy, ", ".join(POLICIES)))
    if not (math.isfinite(headroom) and headroom >= 1.0):
        raise ValueError("export.fp16_headroom=%r: a factor of at least 1 (fp16 is chosen only where the largest "
                         "activation times it stays below %g)" % (headroom, FP16_MAX))


def gemm_dtype(serving: str, policy: str, max_abs_input: Optional[float] = None,
               max_abs_output: Optional[float] = None, headroom: float = 16.0, where: str = "",
               device: str = "cuda") -> Tuple[str, str]:
    """The dtype an artifact for `device` built for agents serving in `serving` runs its matrix products in, and
    why in words.

    "laya": `serving`, as laya computes. "faithful" on a GPU: fp16 when the largest |input| and |output| of the
    products (measured in fp32 on the verify suite's cases: `model.gemm_extremes`) times `headroom` stay below
    FP16_MAX, else bf16 (no measurement: bf16). On the CPU `serving` (bf16: laya never serves fp16 there): CPUs run
    bf16 products natively (AVX-512 BF16, AMX) and fp16 ones mostly through conversions, 13x slower than bf16 at
    256 x 768 x 2304 on an AVX-512 BF16 CPU. fp32 agents: fp32."""
    check_policy(policy, headroom)
    if serving == "fp32":
        return "fp32", "fp32 throughout"
    if policy == "laya":
        return serving, "laya's policy: matrix products under autocast in %s, as laya serves" % serving
    if device != "cuda":
        return serving, ("on the CPU the products stay in %s (fp16 ones have no fast path on most CPUs); fp32 "
                         "elsewhere" % serving)
    limit = FP16_MAX / headroom
    if max_abs_input is None or max_abs_output is None:
        return "bf16", "no activations were measured, and bf16 cannot overflow"
    worst = max(max_abs_input, max_abs_output)
    figures = ("the largest |input| of a matrix product on the verify suite's cases in fp32 is %.4g, of an "
               "output %.4g%s" % (max_abs_input, max_abs_output, " (%s)" % where if where else ""))
    if not math.isfinite(worst) or worst > limit:
        return "bf16", ("fp16 would risk overflow: %s, above fp16's largest value %g / headroom %g = %.4g; bf16 "
                        "cannot overflow" % (figures, FP16_MAX, headroom, limit))
    return "fp16", "%s, within fp16's largest value %g / headroom %g = %.4g" % (figures, FP16_MAX, headroom, limit)


def why_not(artifact_dtype: str, serving: str, device: str, gemm: Optional[str] = None) -> Optional[str]:
    """Why an artifact built for agents serving in `artifact_dtype`, its matrix products in `gemm` (None: the same
    dtype, as every artifact computed before `export.precision`), must not serve an agent serving in `serving`.

    Its products may run in the other 16-bit dtype: the build chose that by measurement (`gemm_dtype`) and verified
    the artifact against laya's eager forward in `artifact_dtype`. An fp32 agent gets fp32 products only."""
    if artifact_dtype != serving:
        knob = ("the checkpoint's amp_dtype (absent means fp16) or LAYA_CUDA_AMP" if device == "cuda"
                else "LAYA_CPU_AMP")
        return ("it computes in %s and this agent serves in %s (laya's choice from %s): its answers would not be "
                "laya's; build the bundle with target.dtypes=[%s]" % (artifact_dtype, serving, knob, serving))
    if gemm is not None and gemm != artifact_dtype and "fp32" in (gemm, artifact_dtype):
        return ("it was built for %s agents but its matrix products run in %s, which no build makes: its manifest "
                "was damaged or hand-edited; rebuild the bundle with `laya-aot build`" % (artifact_dtype, gemm))
    return None

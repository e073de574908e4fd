"""Precompiled TileLang kernels per GPU architecture, driving laya's own fast path (`laya_aot.kernels`).

They cross-compile without a GPU, so a CPU build cannot run them: the build records them unverified
and the first GPU that loads them verifies them against eager (cached per artifact and machine).
They need no particular torch build, only the GPU architecture and the CUDA major version.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from .. import laya_internals as laya_api
from ..manifest import Artifact, Needs, Precision, unsafe_relpath
from ..variant import Machine, cuda_tag
from .base import BuildContext, Built, Exported, Kind, LoadEnv, Outputs, Runner, Skip

NAME = "tilelang"


class TileLangRunner(Runner):
    """laya's own fast path fed only the bundle's precompiled TileLang kernels."""

    def __init__(self, art_dir: Path, agent, art: Artifact):
        laya_api.require("tilelang")  # without the extra: this artifact's one reason names it
        from ..kernels import make_fast_forward

        self.device = agent.device
        self._fast = make_fast_forward(agent, Path(art_dir), str(art.needs.gpu_arch), art.details.get("kernels"))
        # the driver's own figures, kept up to date by its background preload: kernels loaded before the first
        # answer, and what the background loaded, in how long, and what failed there
        self.stats = self._fast.stats

    def __call__(self, ids, att, mpos, mmask, qtype) -> Outputs:
        return self._fast.forward(ids, att, mpos, mmask, qtype)


def laya_precision(dtype: str) -> Precision:
    """What the kernels compute: laya's fast path, whatever `export.precision` says (laya's own kernels)."""
    return Precision("laya", dtype, "laya's fast path: its TileLang kernels compute as laya.load(fast=True) serves")


def build(ctx: BuildContext, exported: Exported) -> Built:
    """Cross-compile the checkpoint's kernel catalogue for every architecture the target names."""
    archs = list(ctx.cfg.target.tilelang_archs or [])
    if ctx.device != "cuda" or not archs:
        raise Skip("target %s has no TileLang architectures (CUDA targets only)" % ctx.cfg.target.name)
    try:
        laya_api.require("tilelang")
    except laya_api.RouteUnavailable as e:  # pragma: no cover - depends on the optional extra
        raise Skip(str(e)) from None
    from .. import kernels
    t0 = time.perf_counter()
    folder = ctx.artifact_name(KIND, NAME)  # tilelang, or tilelang-<dtype> when the build makes several
    out = kernels.build_for_checkpoint(ctx.ckpt, archs, ctx.dtype, exported.ranges.max_tokens, exported.ranges.max_rows,
                                       ctx.staging / folder, jobs=ctx.cfg.jobs)
    lines = []
    for arch, res in out.items():
        ok = [k for k in res["kernels"] if k["status"] == "ok"]
        ctx.add_artifact(KIND, ctx.artifact_name(KIND, "%s-%s" % (NAME, arch)), "%s/%s" % (folder, arch), "cuda",
                         ctx.dtype, res["seconds"], details=res, gpu_arch=arch, precision=laya_precision(ctx.dtype))
        lines.append("%s %d/%d kernels (%d from the kernel cache)" % (arch, len(ok), len(res["kernels"]),
                                                                     res.get("from_cache", 0)))
    return Built(", ".join(lines), record={"seconds_compile": time.perf_counter() - t0})


def load(path: Path, art: Artifact, env: LoadEnv) -> Runner:
    return TileLangRunner(path, env.agent, art)


def probe_env(path: Path, art: Artifact, checkpoint: Path, device: str) -> LoadEnv:
    """laya's agent serving in the kernels' dtype (a probe child's own environment: LAYA_CUDA_AMP is set
    for this process only), its module on the real weights built as the loader builds it (a thin agent given
    `build_eager_module`'s module: laya's, bitwise, without laya's fp32 copy on the CPU)."""
    import os

    os.environ["LAYA_CUDA_AMP"] = str(art.dtype)
    return LoadEnv(device=device, agent=laya_api.eager_agent(str(checkpoint), device=device))


def needs(m: Machine, device: str) -> Needs:
    return Needs(device="cuda", gpu_arch=m.gpu_arch, cuda=m.cuda, machine=m.machine, os=m.os)


def variant(m: Machine, device: str) -> str:
    return "%s-%s-%s-%s" % (cuda_tag(m.cuda or torch.version.cuda or "13.0"), m.gpu_arch, m.machine, m.os)


def check_details(details: Dict[str, Any]) -> Optional[str]:
    """The manifest reader's hook: the kernel files `details.kernels` names stay inside the artifact's directory
    (the driver opens them there); None when they do, else "FIELD: expected ..., got ..."."""
    kernels = details.get("kernels")
    if kernels is None:
        return None
    if not isinstance(kernels, list):
        return "kernels: expected a list, got %s" % repr(kernels)[:80]
    for j, entry in enumerate(kernels):
        if not isinstance(entry, dict):
            return "kernels[%d]: expected an object, got %s" % (j, repr(entry)[:80])
        for key in ("path", "meta_path"):
            rel = entry.get(key)
            if rel is None or rel == "":
                continue
            why = unsafe_relpath(rel) if isinstance(rel, str) else "a file name"
            if why:
                return "kernels[%d].%s: expected a path inside the artifact (%s), got %s" % (j, key, why,
                                                                                           repr(rel)[:80])
    return None


def refuse_device(device: str) -> Optional[str]:
    """On a GPU without the tilelang extra: refused from the manifest with the extra to install, before any probe
    (elsewhere the device mismatch is the reason)."""
    if device != "cuda":
        return None
    try:
        laya_api.require("tilelang")
    except laya_api.RouteUnavailable as e:
        return str(e)
    return None


KIND = Kind(name=NAME, stage="tilelang", build=build, load=load, order=0, native=True, verified_at_build=False,
            reverify=False, needs_module=True, needs=needs, variant=variant, probe_env=probe_env,
            refuse_device=refuse_device, check_details=check_details)

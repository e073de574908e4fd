"""`laya-aot build`: checkpoint -> verified bundle, one stage at a time.

Stages (each its own module, each recorded in the manifest with status, duration and error text):
load -> export -> aoti -> onnx -> tilelang -> inductor_cache -> verify -> manifest.
`load` and `export` are fatal (every artifact derives from the exported program); any later stage
may fail without stopping the build. The build fails only when the checkpoint or config is unusable
or when no artifact at all could be built and verified.
"""
from __future__ import annotations

import datetime as _dt
import logging
import os
import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from .. import __version__
from .. import checkpoint as ckpt_mod
from ..manifest import MANIFEST, SCHEMA, SCHEMA_VERSION, sha256_file, sha256_tree, write_json_atomic
from ..padding import Ranges
from ..variant import Machine, current_machine, variant_string
from . import staging

log = logging.getLogger(__name__)

# rows x tokens x markers at which latency is recorded for ranking (tokens capped at the context)
REFERENCE_SHAPES = ((1, 128, 4), (8, 256, 4))


class BuildError(RuntimeError):
    """The build cannot produce a bundle: unusable checkpoint or config, export failure, nothing verified."""


@dataclass
class Context:
    """What the stages share. Filled in as the build goes."""

    cfg: DictConfig
    ckpt: Path
    info: Dict[str, Any]
    staging: Path
    machine: Machine
    device: str
    dtype: str
    agent: Any = None
    fingerprint: Dict[str, Any] = field(default_factory=dict)
    pad_id: int = 0
    vocab: int = 0
    ep: Any = None
    ep_fp32: Any = None
    ranges: Optional[Ranges] = None
    artifacts: List[Dict[str, Any]] = field(default_factory=list)
    stages: List[Dict[str, Any]] = field(default_factory=list)
    eager_latency_ms: Optional[Dict[str, float]] = None
    smoke: Optional[Dict[str, Any]] = None


# ----------------------------------------------------------------------------------------- stages
def stage_load(ctx: Context) -> str:
    """a. load through laya (its DecisionModel and checkpoint format) and fingerprint the checkpoint."""
    import laya

    # laya.load may normalise tokenizer_config.json in place (laya's _fix_tokenizer_config): fingerprint
    # after it, so the runtime (which loads first too) sees the same bytes
    ctx.agent = laya.load(str(ctx.ckpt), device="cpu")
    ctx.fingerprint = ckpt_mod.fingerprint(ctx.ckpt)
    if ctx.info["option_layout"] == "parallel":
        raise BuildError("checkpoint %s uses option_layout='parallel', whose masks only laya's eager forward "
                         "reads; it cannot be exported" % ctx.ckpt)
    ctx.pad_id = int(ctx.agent.tok.pad_token_id or 0)
    ctx.vocab = min(int(ctx.agent.model.encoder.config.vocab_size), len(ctx.agent.tok))
    return "fingerprint %s..." % ctx.fingerprint["sha256"][:12]


def stage_export(ctx: Context) -> str:
    """b. torch.export with explicit dtypes; the ExportedProgram is saved as the portable artifact."""
    from .export import ExplicitDtypeModel, export_model, ranges_of, torch_dtype

    e = ctx.cfg.export
    max_tokens = int(e.max_tokens or ctx.info["max_len"])
    if max_tokens > ctx.info["max_len"]:
        raise BuildError("export.max_tokens=%d exceeds the checkpoint's context (%d); lower it"
                         % (max_tokens, ctx.info["max_len"]))
    dev = "cuda" if ctx.device == "cuda" and torch.cuda.is_available() else "cpu"
    module = ExplicitDtypeModel(ctx.agent.model, torch_dtype(ctx.dtype), torch_dtype(e.action_head_dtype))
    t0 = time.perf_counter()
    ctx.ep = export_model(module, e.max_rows, max_tokens, e.max_markers, ctx.pad_id, dev)
    seconds = time.perf_counter() - t0
    ctx.ranges = ranges_of(ctx.ep)
    rel = "exported_program/%s.pt2" % ctx.dtype
    path = ctx.staging / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(ctx.ep, str(path))
    _add_artifact(ctx, "exported_program-%s" % ctx.dtype, "exported_program", rel, dev, ctx.dtype, seconds)
    return "ranges %s" % ctx.ranges.as_dict()


def stage_aoti(ctx: Context) -> str:
    """c. AOTInductor package for the target, weights supplied at load from the checkpoint."""
    from safetensors import safe_open

    from .aoti import package

    if ctx.device == "cuda" and not torch.cuda.is_available():
        raise _Skip("target %s needs a %s GPU on the build machine to compile AOTInductor; none is visible "
                    "(run the build on a machine with that GPU)" % (ctx.cfg.target.name, ctx.cfg.target.arch))
    with safe_open(str(ctx.ckpt / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    name = "aoti-%s" % ctx.cfg.target.name
    t0 = time.perf_counter()
    facts = package(ctx.ep, ctx.staging / name, keys, cxx=ctx.cfg.aoti.cxx)
    _add_artifact(ctx, name, "aoti", name, ctx.device, ctx.dtype, time.perf_counter() - t0, details=facts)
    done = "package %.1f MB (weights not inside)" % (facts["package_bytes"] / 1e6)
    if ctx.device == "cpu" and ctx.cfg.aoti.cpu_frozen:
        t0 = time.perf_counter()
        frozen = package(ctx.ep, ctx.staging / (name + "-frozen"), keys, cxx=ctx.cfg.aoti.cxx, frozen=True)
        _add_artifact(ctx, name + "-frozen", "aoti", name + "-frozen", ctx.device, ctx.dtype,
                      time.perf_counter() - t0, details=frozen)
        done += "; frozen package %.1f MB (weights inside, pre-packed)" % (frozen["package_bytes"] / 1e6)
    return done


def stage_onnx(ctx: Context) -> str:
    """d. ONNX, exported from an fp32 program (ONNX Runtime runs on the CPU)."""
    from .export import ExplicitDtypeModel, export_model
    from .onnx_export import export_onnx

    ep = ctx.ep
    if ctx.dtype != "fp32":
        module = ExplicitDtypeModel(ctx.agent.model, torch.float32, torch.float32)
        ep = export_model(module, ctx.ranges.max_rows, ctx.ranges.max_tokens, ctx.ranges.max_markers, ctx.pad_id)
    t0 = time.perf_counter()
    facts = export_onnx(ep, ctx.staging / "onnx" / "model.onnx")
    _add_artifact(ctx, "onnx-fp32", "onnx", "onnx/model.onnx", "cpu", "fp32", time.perf_counter() - t0,
                  details=facts)
    return "opset %s" % facts["opset"]


def stage_tilelang(ctx: Context) -> str:
    """TileLang kernels cross-compiled per GPU architecture (laya_aot.kernels)."""
    archs = list(ctx.cfg.target.tilelang_archs or [])
    if ctx.device != "cuda" or not archs:
        raise _Skip("target %s has no TileLang architectures (CUDA targets only)" % ctx.cfg.target.name)
    try:
        from .. import kernels
    except ImportError as e:  # pragma: no cover - depends on the optional extra
        raise _Skip("TileLang is not installed (pip install 'laya-aot[tilelang]'): %s" % e)
    if not hasattr(kernels, "build_for_checkpoint"):
        raise _Skip("laya_aot.kernels has no build_for_checkpoint in this version")
    t0 = time.perf_counter()
    out = kernels.build_for_checkpoint(ctx.ckpt, archs, ctx.dtype, ctx.ranges.max_tokens, ctx.ranges.max_rows,
                                       ctx.staging / "tilelang", jobs=ctx.cfg.jobs)
    lines = []
    for arch, res in out.items():
        ok = [k for k in res["kernels"] if k["status"] == "ok"]
        rel = "tilelang/%s" % arch
        _add_artifact(ctx, "tilelang-%s" % arch, "tilelang", rel, "cuda", ctx.dtype, res["seconds"],
                      details=res, gpu_arch=arch)
        lines.append("%s %d/%d kernels (%d from the kernel cache)" % (arch, len(ok), len(res["kernels"]),
                                                                     res.get("from_cache", 0)))
    ctx.stages[-1]["seconds_compile"] = time.perf_counter() - t0
    return ", ".join(lines)


def stage_inductor_cache(ctx: Context) -> str:
    """Pre-populated Inductor cache for the compile route (CUDA targets)."""
    if ctx.device != "cuda":
        raise _Skip("the compile route with a warm Inductor cache is built for CUDA targets; on the CPU the "
                    "AOTInductor package is the compiled artifact")
    if not torch.cuda.is_available():
        raise _Skip("target %s needs its GPU on the build machine to compile and save Inductor caches"
                    % ctx.cfg.target.name)
    from .inductor_cache import build_cache, check_in_fresh_process

    name = "compile-%s" % ctx.cfg.target.name
    t0 = time.perf_counter()
    facts = build_cache(ctx.agent, ctx.staging / name, ctx.ranges, ctx.dtype, ctx.cfg.export.action_head_dtype)
    seconds = time.perf_counter() - t0
    try:
        facts["fresh_process"] = check_in_fresh_process(ctx.staging / name, ctx.ckpt, ctx.device)
    except BaseException:
        shutil.rmtree(ctx.staging / name, ignore_errors=True)  # nothing of a cache that would not be used
        raise
    _add_artifact(ctx, name, "compile", name, "cuda", ctx.dtype, seconds, details=facts)
    return "%d shapes, %.1f MB; a fresh process hit it (first call %.1f s)" % (
        len(facts["shapes"]), facts["bytes"] / 1e6, facts["fresh_process"].get("first_call_s", 0.0))


def stage_verify(ctx: Context) -> str:
    """e. each artifact vs the eager fp32 forward; over tolerance -> marked unusable with the figure."""
    from ..runtime.runners import make_runner, model_tensors
    from .verify import cases, latency_ms, reference_outputs, run_padded, smoke_record, verify_runner

    tol = ctx.cfg.verify.tolerance
    case_list = cases(ctx.cfg.verify.seed, ctx.ranges, ctx.vocab, ctx.pad_id)
    reference = ctx.agent.model.float().eval()
    ctx.smoke = smoke_record(reference, ctx.ranges, ctx.vocab, ctx.pad_id)
    ref_batches = {shape: _reference_batch(ctx, shape) for shape in REFERENCE_SHAPES}
    ctx.eager_latency_ms = {"x".join(map(str, shape)): round(latency_ms(
        lambda: _no_grad(reference, batch), ctx.cfg.verify.latency_repeats), 3) for shape, batch in ref_batches.items()}
    tensors = model_tensors(reference)
    references = None
    summary = []
    for art in ctx.artifacts:
        if art["status"] != "built":
            continue
        if art["kind"] == "tilelang" or (art["device"] == "cuda" and not torch.cuda.is_available()):
            art["status"] = "unverified"
            art["verify"] = {"passed": False, "reason": "needs a %s GPU to verify; verify it there with "
                             "`laya-aot verify`" % (art["needs"].get("gpu_arch") or "CUDA")}
            summary.append("%s unverified" % art["name"])
            continue
        t0 = time.perf_counter()
        crash = _probe_native(ctx, art)
        if crash:
            art["verify"] = {"passed": False, "reason": crash, "seconds": round(time.perf_counter() - t0, 3)}
            art["status"] = "failed_verification"
            summary.append("%s FAILED (%s)" % (art["name"], crash))
            continue
        try:
            runner = make_runner(art["kind"], ctx.staging / art["path"], tensors, art["device"], model=reference)
            is_fp32 = art["dtype"] == "fp32"
            references = references or reference_outputs(reference, case_list)
            result = verify_runner(runner, reference, case_list, ctx.ranges, ctx.pad_id, runner.device,
                                   tol.fp32 if is_fp32 else getattr(tol, art["dtype"]),
                                   tol.argmax_fp32 if is_fp32 else tol.argmax_16bit, references)
            if art["kind"] != "exported_program":
                sync = torch.cuda.synchronize if runner.device.type == "cuda" else None
                art["latency_ms"] = {art["device"]: {
                    "x".join(map(str, shape)): round(latency_ms(
                        lambda: run_padded(runner, batch, ctx.ranges, ctx.pad_id, runner.device),
                        ctx.cfg.verify.latency_repeats, sync), 3)
                    for shape, batch in ref_batches.items()}}
        except Exception as e:
            result = {"passed": False, "reason": "running it failed: %s: %s" % (type(e).__name__, e)}
        result["seconds"] = round(time.perf_counter() - t0, 3)
        art["verify"] = result
        art["status"] = "verified" if result["passed"] else "failed_verification"
        summary.append("%s %s" % (art["name"], "ok" if result["passed"] else "FAILED"))
    return ", ".join(summary)


# ----------------------------------------------------------------------------------------- helpers
def _probe_native(ctx: Context, art: Dict[str, Any]) -> Optional[str]:
    """Load a native artifact in a child process first: a crash there must not kill the build."""
    if art["kind"] != "aoti":
        return None
    from ..runtime.probe import probe

    entry = dict(art, sha256=sha256_tree(ctx.staging / art["path"]), ranges=ctx.ranges.as_dict())
    return probe(ctx.staging, entry, ctx.ckpt, art["device"], ctx.machine, manifest_entry=entry)


class _Skip(Exception):
    """A stage that does not apply to this target or machine (recorded as skipped with the reason)."""


def _no_grad(model, batch):
    with torch.no_grad():
        return model(*batch)


def _reference_batch(ctx: Context, shape):
    from .verify import _rows

    rows, tokens, markers = shape
    tokens = min(tokens, ctx.ranges.max_tokens)
    rows = min(rows, ctx.ranges.max_rows)
    g = torch.Generator().manual_seed(7)
    return _rows(g, [tokens] * rows, [markers] * rows, ctx.vocab, ctx.pad_id)


def _add_artifact(ctx: Context, name: str, kind: str, rel: str, device: str, dtype: str, seconds: float,
                  details: Optional[Dict[str, Any]] = None, gpu_arch: Optional[str] = None) -> None:
    m = ctx.machine
    needs: Dict[str, Any] = {"device": device, "machine": m.machine, "os": m.os}
    if kind in ("aoti", "compile", "exported_program"):
        needs.update(torch=m.torch, cxx11_abi=m.cxx11_abi)
    if kind == "aoti" and device == "cpu":
        needs["cpu_isa"] = m.cpu_isa
    if device == "cuda":
        needs.update(gpu_arch=gpu_arch or ctx.cfg.target.arch or m.gpu_arch, cuda=torch.version.cuda)
    if kind == "onnx":
        needs = {"device": "cpu"}
    if kind == "exported_program":
        needs = {"device": device, "torch": m.torch}
    if kind == "tilelang":
        variant = "%s-%s-%s-%s" % ("cu" + (torch.version.cuda or "130").replace(".", ""), gpu_arch, m.machine, m.os)
    else:
        variant = variant_string(kind, m if device == "cpu" else _with_arch(m, needs.get("gpu_arch")), device)
    ctx.artifacts.append({
        "name": name, "kind": kind, "path": rel, "status": "built", "variant": variant, "needs": needs,
        "device": device, "dtype": dtype,
        "action_head_dtype": ctx.cfg.export.action_head_dtype if kind != "onnx" else "fp32",
        "ranges": ctx.ranges.as_dict() if ctx.ranges else None,
        "build_seconds": round(seconds, 3), "details": details or {},
    })


def _with_arch(m: Machine, arch: Optional[str]) -> Machine:
    from dataclasses import replace

    return replace(m, gpu_arch=arch, cuda=torch.version.cuda or m.cuda)


def _hash_artifacts(ctx: Context) -> None:
    for art in ctx.artifacts:
        if not art.get("path"):
            continue
        p = ctx.staging / art["path"]
        art["sha256"] = sha256_tree(p) if p.is_dir() else sha256_file(p)
        art["size"] = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size


def manifest_of(ctx: Context) -> Dict[str, Any]:
    tol = ctx.cfg.verify.tolerance
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "laya_aot_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "checkpoint": dict(ctx.info, fingerprint=ctx.fingerprint),
        "target": OmegaConf.to_container(ctx.cfg.target, resolve=True),
        "build_machine": ctx.machine.as_dict(),
        "tolerance": OmegaConf.to_container(tol, resolve=True),
        "ranges": ctx.ranges.as_dict() if ctx.ranges else None,
        "eager_latency_ms": {"cpu": ctx.eager_latency_ms} if ctx.eager_latency_ms else {},
        # the batch and eager fp32 outputs the runtime checks a loaded artifact against (verify.smoke_record)
        "smoke": ctx.smoke,
        "stages": ctx.stages,
        "artifacts": ctx.artifacts,
        "config": OmegaConf.to_container(ctx.cfg, resolve=True),
    }


StageFn = Callable[[Context], str]

STAGES: List[tuple] = [
    ("load", stage_load, True, None),
    ("export", stage_export, True, None),
    ("aoti", stage_aoti, False, "aoti"),
    ("onnx", stage_onnx, False, "onnx"),
    ("tilelang", stage_tilelang, False, "tilelang"),
    ("inductor_cache", stage_inductor_cache, False, "inductor_cache"),
    ("verify", stage_verify, True, None),
]


def _run_stage(ctx: Context, name: str, fn: StageFn, fatal: bool, enabled: bool, report) -> None:
    rec: Dict[str, Any] = {"name": name, "status": "running"}
    ctx.stages.append(rec)
    t0 = time.perf_counter()
    if not enabled:
        rec.update(status="skipped", error="disabled by stages.%s=false" % name, seconds=0.0)
        report(rec)
        return
    report(rec)
    try:
        rec["summary"] = fn(ctx)
        rec["status"] = "ok"
    except _Skip as e:
        rec.update(status="skipped", error=str(e))
    except BaseException as e:  # noqa: BLE001 - recorded, then re-raised when fatal
        rec.update(status="failed", error="%s: %s" % (type(e).__name__, e))
        log.debug("stage %s failed:\n%s", name, traceback.format_exc())
        if fatal or isinstance(e, (KeyboardInterrupt, SystemExit)):
            rec["seconds"] = round(time.perf_counter() - t0, 3)
            report(rec)
            if isinstance(e, (BuildError, KeyboardInterrupt, SystemExit)):
                raise
            raise BuildError("stage %s failed: %s: %s" % (name, type(e).__name__, e)) from e
        _record_failed_artifact(ctx, name, rec["error"])
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    report(rec)


def _record_failed_artifact(ctx: Context, stage: str, error: str) -> None:
    kind = {"aoti": "aoti", "onnx": "onnx", "tilelang": "tilelang", "inductor_cache": "compile"}.get(stage)
    if kind:
        ctx.artifacts.append({"name": "%s-%s" % (kind, ctx.cfg.target.name), "kind": kind, "path": None,
                              "status": "build_failed", "error": error, "device": ctx.device,
                              "needs": {"device": ctx.device}, "variant": None})


def _refuse_foreign_output(out: Path) -> None:
    """A rebuild replaces a previous bundle; anything else at the output path is never touched."""
    from ..manifest import BundleError, read_manifest

    if not out.exists():
        return
    if out.is_dir() and not any(out.iterdir()):
        return
    try:
        read_manifest(out)
    except BundleError:
        raise BuildError("output_dir %s exists and is not a laya-aot bundle; a build replaces the whole "
                         "directory, so choose another output_dir or remove it first" % out) from None


def default_dtype(target: Any) -> str:
    return str(target.dtype or ("fp32" if target.device == "cpu" else "bf16"))


def build(cfg: DictConfig, report: Callable[[Dict[str, Any]], None] = lambda rec: None) -> Dict[str, Any]:
    """Run every stage and publish the bundle; returns the manifest. Raises BuildError when unusable."""
    try:
        ckpt = ckpt_mod.resolve(cfg.checkpoint)
        info = ckpt_mod.describe(ckpt, cfg.checkpoint)
    except ckpt_mod.CheckpointError as e:
        raise BuildError(str(e)) from e
    out = Path(cfg.output_dir or os.path.join("artifacts", info["name"]))
    _refuse_foreign_output(out)
    device = str(cfg.target.device)
    if device not in ("cpu", "cuda"):
        raise BuildError("target.device=%r is not supported; use cpu or cuda" % device)
    stage_dir = staging.new_staging(out)
    ctx = Context(cfg=cfg, ckpt=ckpt, info=info, staging=stage_dir, machine=current_machine(device),
                  device=device, dtype=default_dtype(cfg.target))
    try:
        for name, fn, fatal, switch in STAGES:
            enabled = True if switch is None else bool(getattr(cfg.stages, switch))
            _run_stage(ctx, name, fn, fatal, enabled, report)
        usable = [a for a in ctx.artifacts if a["status"] == "verified" and a["kind"] != "exported_program"]
        if not usable and not any(a["status"] == "unverified" for a in ctx.artifacts):
            why = ["stage %s: %s" % (s["name"], s.get("error")) for s in ctx.stages if s["status"] == "failed"]
            why += ["%s: %s" % (a["name"], (a.get("verify") or {}).get("reason") or a.get("error"))
                    for a in ctx.artifacts if a["status"] != "verified"]
            raise BuildError("no artifact could be built and verified: %s" % ("; ".join(why) or "see above"))
        _hash_artifacts(ctx)
        manifest = manifest_of(ctx)
        write_json_atomic(stage_dir / MANIFEST, manifest)
        staging.publish(stage_dir, out)
    except BaseException:
        staging.discard(stage_dir)
        raise
    manifest["output_dir"] = str(out)
    return manifest

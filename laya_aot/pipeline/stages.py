"""`laya-aot build`: checkpoint -> verified bundle, one stage at a time.

Stages, each recorded in the manifest with status, duration and error text: `load`, then one stage per
artifact kind in the registry's order (`exported_program`, `aoti`, `onnx`, `tilelang`, `inductor_cache`),
then `verify`. `load` and the portable program's stage are fatal (every artifact derives from it); any
other kind may fail without stopping the build. The build fails only when the checkpoint or config is
unusable or when no artifact at all could be built and verified.
"""
from __future__ import annotations

import datetime as _dt
import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from omegaconf import DictConfig, OmegaConf

from .. import checkpoint as ckpt_mod
from .. import demo, kinds, progress, staging, tokenizer_snapshot, verification
from .. import laya_internals as laya_api
from .._version import __version__
from ..bundle_format import MAX_TOKENIZER_SNAPSHOT_BYTES, record_files, write_manifest
from ..errors import LayaAotError
from ..files import make_readable, sha256_file, sha256_tree
from ..kinds import BuildContext, Built, Kind, Skip, model_tensors
from ..kinds.exported_program import check_settings as check_export_settings
from ..manifest import (
    SCHEMA,
    SCHEMA_VERSION,
    Artifact,
    Bundle,
    CheckpointInfo,
    Fingerprint,
    Needs,
    ProbeVerdict,
    TokenizerSnapshot,
    VerifyResult,
)
from ..numerics import precision
from ..numerics.tolerance import Tolerance
from ..padding import Ranges
from ..variant import build_machine, current_gpu_arch
from ..verification import latency_ms, random_rows, run_padded, smoke_record
from .children import ChildGuard

log = logging.getLogger(__name__)

# rows x tokens x markers at which latency is recorded for ranking (tokens capped at the context)
# the calls an artifact's latency is measured on at build (rows, tokens, markers; capped by its ranges): one row
# short, a few rows medium and, on a GPU, many rows long; the loader ranks artifacts by their sum (select.rank)
REFERENCE_SHAPES = ((1, 128, 4), (8, 256, 4))
WARMUP_ROUNDS = 2  # untimed rounds of every serving artifact's calls before the timed ones
LONG_SHAPE = (32, 512, 4)


def reference_shapes(device: str) -> Tuple[Tuple[int, int, int], ...]:
    """The mix measured on `device`: the long call only on a GPU (on a CPU it costs minutes of every build of a
    large checkpoint and ranks the same artifacts as the medium one)."""
    return REFERENCE_SHAPES + ((LONG_SHAPE,) if device == "cuda" else ())

Report = Callable[[Dict[str, Any]], None]


class BuildError(LayaAotError, RuntimeError):
    """The build cannot produce a bundle: unusable checkpoint or config, export failure, nothing verified."""


class BuildResult(NamedTuple):
    bundle: Bundle
    output_dir: Path


def stage_load(ctx: BuildContext) -> str:
    """Load through laya (its DecisionModel and checkpoint format) and fingerprint the checkpoint."""
    import laya

    # laya.load may normalise tokenizer_config.json in place (laya's _fix_tokenizer_config): fingerprint
    # after it, so the runtime (which loads first too) sees the same bytes
    ctx.agent = laya.load(str(ctx.ckpt), device="cpu")
    ctx.fingerprint = ckpt_mod.fingerprint(ctx.ckpt)
    if ctx.info["option_layout"] == "parallel":
        raise BuildError("checkpoint %s uses option_layout='parallel', whose masks only laya's eager forward "
                         "reads; it cannot be exported" % ctx.ckpt)
    ctx.pad_id = laya_api.pad_id(ctx.agent)
    ctx.vocab = laya_api.vocab(ctx.agent)
    ctx.tokenizer_snapshot = _tokenizer_snapshot(ctx)
    return "fingerprint %s...; tokenizer snapshot %s" % (ctx.fingerprint["sha256"][:12],
                                                         "shipped" if ctx.tokenizer_snapshot else "not shipped")


def _tokenizer_snapshot(ctx: BuildContext) -> Optional[Tuple[str, str]]:
    """laya's tokenizer as a proven snapshot for the manifest (None, logged: it cannot be made, or it is larger
    than MAX_TOKENIZER_SNAPSHOT_BYTES): a service's first start on a new machine then skips transformers."""
    made = tokenizer_snapshot.make(str(ctx.ckpt / ckpt_mod.TOKENIZER_DIR), ctx.agent.tok)
    size = len(made[1].encode("utf-8")) if made is not None else 0
    if size > MAX_TOKENIZER_SNAPSHOT_BYTES:
        log.info("tokenizer snapshot not shipped: %d bytes, more than %d", size, MAX_TOKENIZER_SNAPSHOT_BYTES)
        return None
    return made


def stage_verify(ctx: BuildContext) -> str:
    """Each artifact against the eager fp32 forward; over its rule -> marked unusable with the figure."""
    tol = _tolerance(ctx.cfg)
    todo = [art for art in ctx.artifacts if art.status == "built"]
    with progress.task("verify: the eager fp32 reference", total=len(todo)) as line:
        return _verify_all(ctx, tol, todo, line)


def _verify_all(ctx: BuildContext, tol: Tolerance, todo: List[Artifact], line: progress.Task) -> str:
    """The stage's summary names each artifact's verdict and where the stage's time went (the reference, each
    artifact, the timing): a GPU build's verification takes minutes, and the manifest keeps the summary."""
    spent: Dict[str, float] = {}
    t0 = time.perf_counter()
    model = ctx.agent.model.float().eval()
    ctx.smoke = smoke_record(model, ctx.ranges, ctx.vocab, ctx.pad_id)
    ref_batches = {shape: _reference_batch(ctx, shape) for shape in reference_shapes(ctx.device)}
    repeats = ctx.cfg.verify.latency_repeats
    ctx.eager_latency_ms = {"x".join(map(str, shape)): round(latency_ms(
        lambda b=batch: _no_grad(model, b), repeats), 3) for shape, batch in ref_batches.items()}
    tensors = model_tensors(model)
    spent["eager timing"], t0 = time.perf_counter() - t0, time.perf_counter()
    ref = verification.reference(model, ctx.ranges, ctx.vocab, ctx.pad_id, ctx.cfg.verify.seed, tol)
    spent["fp32 reference"] = time.perf_counter() - t0
    gpu_agents: Dict[str, Any] = {}
    serving: Dict[str, Tuple[Any, Artifact]] = {}
    summary = []
    for art in todo:
        line.describe("verify: %s" % art.name)
        t0 = time.perf_counter()
        summary.append(_verify_one(ctx, art, ref, tensors, gpu_agents, serving))
        spent[art.name] = time.perf_counter() - t0
        line.advance()
    if serving:
        line.describe("verify: timing %s together" % ", ".join(serving))
        t0 = time.perf_counter()
        _time_together(ctx, serving, ref_batches)
        spent["timing together"] = time.perf_counter() - t0
    return "%s (%s)" % (", ".join(summary), ", ".join("%s %.1f s" % kv for kv in spent.items()))


def _time_together(ctx: BuildContext, serving: Dict[str, Tuple[Any, Artifact]], ref_batches) -> None:
    """The verified serving artifacts' latencies (ms) on each reference call, padded as the runtime pads it, timed
    in interleaved rounds (`verification.interleaved_ms`), so that a repeat build on a busy machine ranks them
    the same."""
    calls: List[verification.Call] = []
    for name, (runner, _) in serving.items():
        sync = torch.cuda.synchronize if runner.device.type == "cuda" else None
        for shape, batch in ref_batches.items():
            calls.append((name, "x".join(map(str, shape)), lambda r=runner, b=batch: run_padded(
                r, b, ctx.ranges, ctx.pad_id, r.device), sync))
    medians, spread = verification.interleaved_ms(calls, ctx.cfg.verify.latency_repeats, warmup=WARMUP_ROUNDS)
    for name, (_, art) in serving.items():
        art.latency_ms, art.latency_spread_ms = {art.device: medians[name]}, {art.device: spread[name]}


def _verify_one(ctx: BuildContext, art: Artifact, ref: verification.Reference, tensors,
                gpu_agents: Dict[str, Any], serving: Dict[str, Tuple[Any, Artifact]]) -> str:
    """One artifact against the eager fp32 forward: its verdict goes into `art`; returns its summary word."""
    kind = kinds.get(art.kind)
    why_not_here = _cannot_verify_here(kind, art)
    if why_not_here:
        art.status = "unverified"
        art.verify = _not_verified(why_not_here)
        return "%s unverified" % art.name
    t0 = time.perf_counter()
    probed: Dict[str, Any] = {}
    crash = _probe_native(ctx, kind, art, probed)
    if crash:
        art.verify = _not_verified(crash, time.perf_counter() - t0)
        art.status = "failed_verification"
        return "%s FAILED (%s)" % (art.name, crash)
    try:
        runner = kind.load(ctx.staging / art.path, art, _load_env(ctx, kind, art, ref, tensors, gpu_agents))
        result = verification.verify_artifact(runner, art.dtype, ref, art.device, label=art.name,
                                              gemm=art.precision.gemm if art.precision else None)
        if kind.serves and result.passed:  # timed with the others once all are verified
            serving[art.name] = (runner, art)
    except Exception as e:  # noqa: BLE001 - recorded as this artifact's failure
        result = _not_verified("running it failed: %s: %s" % (type(e).__name__, e))
    result.seconds = round(time.perf_counter() - t0, 3)
    art.verify = result
    art.status = "verified" if result.passed else "failed_verification"
    if result.passed and probed:  # a start on a machine with this one's facts takes it (`probe.cached_verdict`)
        art.probe_verdict = ProbeVerdict(probed["key"], probed.get("probe_graphs", "not probed"))
    return "%s %s" % (art.name, "ok" if result.passed else "FAILED")


def _load_env(ctx: BuildContext, kind: Kind, art: Artifact, ref: verification.Reference, tensors,
              gpu_agents: Dict[str, Any]) -> kinds.LoadEnv:
    """What the build loads an artifact with to verify and time it: as an agent serves it, CUDA graphs included
    where the kind replays them: timed without them, an AOTInductor artifact's small calls were timed slower than
    it serves them, against TileLang's, which laya's fast path always graphs, and the loader ranks on those figures."""
    env = kinds.LoadEnv(device=art.device, tensors=tensors, model=ref.model,
                        cuda_graphs=kind.replays_graphs(art.device))
    if not kind.verified_at_build:  # drives laya's own agent: one on this GPU, serving in the artifact's dtype
        env.agent = gpu_agents.get(art.dtype) or gpu_agents.setdefault(art.dtype, _gpu_agent(ctx, art.dtype))
    return env


def _not_verified(reason: str, seconds: Optional[float] = None) -> VerifyResult:
    return VerifyResult(passed=False, reason=reason, seconds=None if seconds is None else round(seconds, 3))


def _cannot_verify_here(kind: Kind, art: Artifact) -> Optional[str]:
    """Why this build machine cannot run the artifact (None: it can). A kind not verified at build in
    general (cross-compiled TileLang) is verified here all the same when this machine has its GPU."""
    if art.device != "cuda":
        return None
    here = current_gpu_arch() if torch.cuda.is_available() else None
    if kind.verified_at_build:
        return None if here else "needs a %s GPU to verify; verify it there with `laya-aot verify`" % art.needs.gpu_arch
    if here and str(art.needs.gpu_arch).rstrip("a") == here:
        return None
    return ("cross-compiled for %s without that GPU here; the first %s GPU that loads it verifies it against "
            "eager before it serves" % (art.needs.gpu_arch, art.needs.gpu_arch))


def _gpu_agent(ctx: BuildContext, dtype: str):
    """laya's agent for the checkpoint on this GPU, serving in `dtype` (LAYA_CUDA_AMP, read by laya.load)."""
    import laya

    before = os.environ.get("LAYA_CUDA_AMP")
    os.environ["LAYA_CUDA_AMP"] = dtype
    try:
        agent = laya.load(str(ctx.ckpt), device="cuda")
    finally:
        if before is None:
            os.environ.pop("LAYA_CUDA_AMP", None)
        else:
            os.environ["LAYA_CUDA_AMP"] = before
    got = laya_api.serving_dtype(agent)
    if got != dtype:
        raise RuntimeError("laya serves this checkpoint in %s on this GPU, not %s" % (got, dtype))
    return agent


def _probe_native(ctx: BuildContext, kind: Kind, art: Artifact, probed: Dict[str, Any]) -> Optional[str]:
    """Load a native artifact in a child process first: a crash there must not kill the build. `probed` gets
    the verdict's figures and its key (`probe.verdict_key`) when it passed."""
    if not kind.native:
        return None
    from ..probe import probe, verdict_key

    p = ctx.staging / art.path
    art.sha256 = sha256_tree(p) if p.is_dir() else sha256_file(p)
    why = probe(ctx.staging, art, ctx.ckpt, art.device, ctx.machine, probed)
    if why is None:
        probed["key"] = verdict_key(art, ctx.machine, art.device)
    return why


def _no_grad(model, batch):
    with torch.no_grad():
        return model(*batch)


def _reference_batch(ctx: BuildContext, shape: Tuple[int, int, int]):
    rows, tokens, markers = shape
    tokens = min(tokens, ctx.ranges.max_tokens)
    rows = min(rows, ctx.ranges.max_rows)
    g = torch.Generator().manual_seed(7)
    return random_rows(g, [tokens] * rows, [markers] * rows, ctx.vocab, ctx.pad_id)


def _tolerance(cfg: DictConfig) -> Tolerance:
    return Tolerance(**OmegaConf.to_container(cfg.verify.tolerance, resolve=True))


def _hash_artifacts(ctx: BuildContext) -> None:
    for art in ctx.artifacts:
        if art.path:
            record_files(ctx.staging, art)  # each file's digest and size (what unpack and fetch check), the sum
            art.build_machine = ctx.machine.as_dict()


def _shipped_verdicts_hold(ctx: BuildContext) -> None:
    """A probe verdict is shipped only for the entry it was given on: an artifact whose loaded fields changed
    after its probe (no stage does that today) ships none, and its first start on a machine probes it."""
    from ..probe import verdict_key

    for art in ctx.artifacts:
        if art.probe_verdict is not None and art.probe_verdict.key != verdict_key(art, ctx.machine, art.device):
            log.warning("%s changed after its probe; its probe verdict is not shipped", art.name)
            art.probe_verdict = None


def bundle_of(ctx: BuildContext) -> Bundle:
    _shipped_verdicts_hold(ctx)
    info = ctx.info
    checkpoint = CheckpointInfo(name=info["name"], path=info["path"], max_len=info["max_len"],
                                n_actions=info["n_actions"], option_layout=info["option_layout"],
                                head_layers=info["head_layers"], amp_dtype=info["amp_dtype"],
                                fingerprint=Fingerprint(ctx.fingerprint["sha256"], ctx.fingerprint["files"],
                                                        ctx.fingerprint["parts"], ctx.fingerprint["part_bytes"]))
    return Bundle(
        schema=SCHEMA, schema_version=SCHEMA_VERSION, laya_aot_version=__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        checkpoint=checkpoint, artifacts=ctx.artifacts,
        target=OmegaConf.to_container(ctx.cfg.target, resolve=True),
        build_machine=ctx.machine.as_dict(), tolerance=_tolerance(ctx.cfg), ranges=ctx.ranges,
        eager_latency_ms={"cpu": ctx.eager_latency_ms} if ctx.eager_latency_ms else {},
        smoke=ctx.smoke, stages=ctx.stages,
        tokenizer_snapshot=TokenizerSnapshot(*ctx.tokenizer_snapshot) if ctx.tokenizer_snapshot else None,
        config=OmegaConf.to_container(ctx.cfg, resolve=True))


Step = Callable[[BuildContext], Union[str, Built]]
Stage = Tuple[str, Step, bool, Optional[Kind], Optional[str]]


def _kind_step(kind: Kind) -> Step:
    """A kind's build step, handed the program the last exported_program stage returned."""
    return lambda ctx: kind.build(ctx, ctx.exported)


def stages(dtypes: List[str]) -> List[Stage]:
    """(name, step, fatal, kind, dtype): load; per dtype, one stage per kind in the registry's order (a kind
    with a fixed dtype once); verify."""
    out: List[Stage] = [("load", stage_load, True, None, None)]
    for i, dtype in enumerate(dtypes):
        out += [(k.stage, _kind_step(k), not k.optional, k, k.fixed_dtype or dtype) for k in kinds.REGISTRY
                if not (k.fixed_dtype and i)]
    return out + [("verify", stage_verify, True, None, None)]


def _run_stage(ctx: BuildContext, name: str, fn: Step, fatal: bool, enabled: bool,
               report: Report, kind: Optional[Kind], dtype: Optional[str]) -> None:
    rec: Dict[str, Any] = {"name": name, "status": "running"}
    if dtype is not None:
        ctx.dtype = dtype
        if len(ctx.dtypes) > 1:
            rec["dtype"] = dtype
    ctx.stages.append(rec)
    t0 = time.perf_counter()
    if not enabled:
        rec.update(status="skipped", error="disabled by stages.%s=false" % name, seconds=0.0)
        report(rec)
        return
    report(rec)
    try:
        done = fn(ctx)
        if isinstance(done, Built):  # a kind's step: its facts go into the record, a program to the next kinds
            rec["summary"] = done.summary
            rec.update(done.record)
            if done.exported is not None:
                ctx.exported = done.exported
        else:
            rec["summary"] = done
        rec["status"] = "ok"
    except Skip as e:
        rec.update(status="skipped", error=str(e))
    except KeyboardInterrupt:
        raise  # not a stage's failure: the command says it once (cli._build)
    except BaseException as e:  # noqa: BLE001 - recorded, then re-raised when fatal
        rec.update(status="failed", error="%s: %s" % (type(e).__name__, e))
        log.debug("stage %s failed:\n%s", name, traceback.format_exc())
        if fatal or isinstance(e, SystemExit):
            rec["seconds"] = round(time.perf_counter() - t0, 3)
            report(rec)
            if isinstance(e, (BuildError, SystemExit)):
                raise
            raise BuildError("stage %s failed: %s: %s" % (name, type(e).__name__, e)) from e
        if kind is not None:
            ctx.artifacts.append(Artifact(name=ctx.artifact_name(kind), kind=kind.name, status="build_failed",
                                          device=ctx.device, needs=Needs(device=ctx.device), dtype=ctx.dtype,
                                          error=rec["error"]))
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    report(rec)


def _prune_unlisted(stage_dir: Path, bundle: Bundle) -> None:
    """Remove what a failed stage left behind: a published bundle holds its manifest's files and nothing else,
    which is how the next build (`staging.complete_bundle`) knows the directory is its own to replace."""
    listed = {rel for a in bundle.artifacts for rel in a.files}
    for dirpath, dirnames, filenames in os.walk(stage_dir, topdown=False):
        for name in filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(stage_dir).as_posix()
            if rel not in listed and rel != staging.MARKER:
                log.info("not publishing %s: no artifact of the manifest lists it", rel)
                p.unlink()
        for name in dirnames:
            try:
                (Path(dirpath) / name).rmdir()  # only when empty
            except OSError:
                pass


def output_path(output_dir: Optional[str], checkpoint: str, target: str) -> str:
    """Where a build writes: `output_dir` with `{checkpoint}` and `{target}` filled in (so one multirun
    pattern names every job's partial bundle), or artifacts/<checkpoint> when unset."""
    pattern = output_dir or os.path.join("artifacts", "{checkpoint}")
    return pattern.replace("{checkpoint}", checkpoint).replace("{target}", target)


def build(cfg: DictConfig, report: Report = lambda rec: None) -> BuildResult:
    """Run every stage and publish the bundle. Raises BuildError when nothing usable can be built."""
    device = str(cfg.target.device)
    if device not in ("cpu", "cuda"):
        raise BuildError("target.device=%r is not supported; use cpu or cuda" % device)
    try:  # the settings first: a mistake in one is named before the checkpoint is made, read or loaded
        check_export_settings(cfg.export, device)
    except ValueError as e:
        raise BuildError(str(e)) from e
    try:
        ckpt = demo.resolve(cfg.checkpoint)  # a path, a hub id, or the demo checkpoint (made when absent)
        info = ckpt_mod.describe(ckpt, cfg.checkpoint)
    except ckpt_mod.CheckpointError as e:
        raise BuildError(str(e)) from e
    out = Path(output_path(cfg.output_dir, info["name"], str(cfg.target.name)))
    try:
        staging.may_replace(out, "a build", bool(cfg.get("overwrite", False)), fix="overwrite=true")
    except staging.OutputRefused as e:
        raise BuildError(str(e)) from None
    except OSError as e:
        raise BuildError(_unwritable(out, e)) from None
    try:
        dtypes = precision.build_dtypes(device, cfg.target.arch, {"amp_dtype": info["amp_dtype"]},
                                        list(cfg.target.dtypes or []))
    except ValueError as e:
        raise BuildError(str(e)) from e
    # the guard: compiler processes die with the build, even a build killed with SIGKILL
    try:
        with ChildGuard(), staging.staged(out, lambda e: BuildError(_unwritable(out, e))) as stage_dir:
            ctx = BuildContext(cfg=cfg, ckpt=ckpt, info=info, staging=stage_dir, machine=build_machine(device),
                               device=device, dtypes=dtypes)
            for name, fn, fatal, kind, dtype in stages(dtypes):
                enabled = fatal or bool(getattr(cfg.stages, name))
                _run_stage(ctx, name, fn, fatal, enabled, report, kind, dtype)
            _require_something_usable(ctx)
            _hash_artifacts(ctx)
            bundle = bundle_of(ctx)
            _prune_unlisted(stage_dir, bundle)
            make_readable(stage_dir)  # 0644/0755: a service running as another user must read the bundle
            write_manifest(stage_dir, bundle)
    except staging.OutputBusy as e:  # another build writes this output now: it alone publishes there
        raise BuildError(str(e)) from None
    return BuildResult(bundle, out)


def _require_something_usable(ctx: BuildContext) -> None:
    """A BuildError listing every failure when no artifact serves and none is left for a GPU to verify."""
    usable = [a for a in ctx.artifacts if a.status == "verified" and kinds.get(a.kind).serves]
    if not usable and not any(a.status == "unverified" for a in ctx.artifacts):
        why = ["stage %s: %s" % (s["name"], s.get("error")) for s in ctx.stages if s["status"] == "failed"]
        why += ["%s: %s" % (a.name, (a.verify.reason if a.verify else None) or a.error)
                for a in ctx.artifacts if a.status != "verified"]
        raise BuildError("no artifact could be built and verified: %s" % ("; ".join(why) or "see above"))


def _unwritable(out: Path, e: OSError) -> str:
    return ("cannot write output_dir %s (%s); choose an output_dir you can write to (output_dir=DIR) or fix the "
            "permissions of %s" % (out, e.strerror or e, out.parent if not out.exists() else out))


__all__ = ["BuildError", "BuildResult", "Ranges", "build"]

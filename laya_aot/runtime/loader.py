"""`laya_aot.load`: a laya Agent whose forward is the best verified artifact this machine can run.

Order of trust, cheapest first, and nothing native is loaded until every check before it passed:
manifest schema -> checkpoint fingerprint -> machine compatibility and build-time verification ->
sha256 of the artifact's bytes -> a probe in a child process (native artifacts, once per machine) ->
in-process load -> a smoke comparison with the build's eager fp32 outputs on one seeded batch -> install.
Every artifact that falls out gets one reason; when none is left the agent runs eager with one
RuntimeWarning listing them all (or `strict=True` raises with the same list).

The checks up to the probe do not need laya's agent, so they run in a thread while `laya.load` reads
the checkpoint: a first start on a machine then pays for the probe child only where it outlasts that.
The probe child runs the artifact on stand-in weights (probe._child), so what it shows (that the
package loads and runs here) does not depend on the checkpoint: it starts as soon as the artifact's
bytes match the manifest and the checkpoint's configs and tokenizer match the build's, while the
weights' digest is still being computed; a fingerprint that does not match kills it, and its verdict
is recorded only after the fingerprint matched. The service's own process loads nothing native
before every check passed.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import checkpoint as ckpt_mod
from .. import kinds, precision
from .. import laya_internals as laya_api
from ..bundle_format import artifact_path, check_artifact_hash, read_bundle
from ..distribution.fetch import resolve_for_load
from ..manifest import Artifact, Bundle, BundleError, VerifyResult
from ..tolerance import Agreement, DecisionAgreement, rule_for
from ..variant import current_machine
from .backend import DEFAULT_NEAR_TIES, AOTBackend, EagerFallback, near_tie_mode
from .eager_module import EagerModule
from .select import rank, reject_reason

log = logging.getLogger(__name__)


class _Early:
    """The hash and probe of the first candidate artifact, and the checkpoint's fingerprint, overlapped
    with `laya.load`.

    A probe child starts only for an artifact fit for this machine whose bytes match the manifest, and
    only when the checkpoint's small files (configs, tokenizer) match the ones the bundle was built
    from: the checks `_choose` makes before probing, except the weights' digest, which the child does
    not depend on and which runs beside it (a mismatch kills the child). `_choose` repeats every check, takes
    the started probe when it reaches that artifact on the same device, and `close` kills a probe
    nobody took.
    """

    def __init__(self, ckpt: Path, bundle: Path, device: Optional[str], prefer: Optional[str],
                 pin: Optional[str] = None):
        self.pending = None
        self.device: Optional[str] = None
        self.started_after_s: Optional[float] = None  # from load() to the probe child's start
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(ckpt, bundle, device, prefer, pin), daemon=True,
                                        name="laya-aot-early-probe")
        self._thread.start()

    def _run(self, ckpt: Path, bundle: Path, device: Optional[str], prefer: Optional[str],
             pin: Optional[str]) -> None:
        from ..probe import start

        try:
            manifest = read_bundle(bundle, kinds.BY_NAME, sha256=pin)
            if not ckpt_mod.small_files_match(ckpt, manifest.checkpoint.fingerprint.files):  # another architecture
                return                                                                       # or tokenizer
            dev = str(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            dev_type = torch.device(dev).type
            machine = current_machine(dev)
            # what laya will serve in once loaded (the agent does not exist yet); _choose uses the agent's own
            serving = precision.expected_serving_dtype(ckpt_mod.read_config(ckpt), dev_type, machine.gpu_arch)
            candidates, _ = rank(manifest.artifacts, dev_type, prefer)
            for art in candidates:
                if reject_reason(art, machine, dev_type, serving) is None:
                    if kinds.get(art.kind).native and check_artifact_hash(bundle, art) is None:
                        self.device = dev
                        self.started_after_s = round(time.perf_counter() - self._t0, 3)
                        self.pending = start(bundle, art, ckpt, dev, machine)
                    break
            # the fingerprint (seconds for a large checkpoint never seen here) is cached for _choose
            if manifest.checkpoint.fingerprint.sha256 != ckpt_mod.fingerprint(ckpt)["sha256"] and self.pending:
                self.pending.cancel()
                self.pending = None
        except Exception as e:  # noqa: BLE001 - _choose repeats every check and reports it
            log.debug("early probe not started: %s", e)

    def take(self, name: str, device: str):
        """The probe started for artifact `name` on `device`, or None."""
        self._thread.join()
        p = self.pending
        if p is not None and p.entry.name == name and self.device == device:
            self.pending = None
            return p
        return None

    def close(self) -> None:
        self._thread.join()
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None


# when the loader builds laya's eager module (see `load`)
EAGER_MODULE_MODES = ("lazy", "background", "now")


class NoArtifactError(RuntimeError):
    """strict=True and no artifact of the bundle can serve this agent; the message lists every reason."""


def _format(rejected: List[Tuple[str, str]]) -> str:
    return "; ".join("%s: %s" % (name, why) for name, why in rejected) or "the bundle lists no artifacts"


def _smoke_check(agent, backend: AOTBackend, art: Artifact, manifest: Bundle) -> Optional[str]:
    """Run the installed artifact on one seeded batch and compare it with a reference (catches a bad load).

    The reference is the build's eager fp32 forward on that batch, stored in the manifest
    (verification.smoke_record), so a start does not also warm up and run the eager model; a bundle
    written before that record existed is compared with the eager forward here instead.
    """
    from ..verification import compare, smoke_batch, smoke_from_record

    dev = agent.device
    # the bound the artifact met at verification (for a 16-bit one it depends on laya's eager figures there)
    bound = art.verify.tolerance if art.verify and art.verify.tolerance is not None else None
    if bound is None:
        return "its manifest entry records no verified tolerance; rebuild the bundle with `laya-aot build`"
    record = manifest.smoke
    vocab = laya_api.vocab(agent)
    why = smoke_record_problem(record, vocab, art) if record else None
    if why:  # not run: a batch made here, against the eager forward, checks the artifact instead
        (log.info if record.sha256 is None else log.warning)("laya-aot: the bundle's smoke record is not used: %s",
                                                             why)
        record = None
    with torch.no_grad():
        if record:
            batch, ref = smoke_from_record(record)
        else:
            batch = smoke_batch(art.ranges, vocab, backend.pad_id)
            ref = backend.stock_forward(*(x.to(dev) for x in batch))
            # this reference runs in the agent's own precision: it may itself be that far from fp32
            if art.verify.eager_in_dtype is not None:
                bound += art.verify.eager_in_dtype.worst
        got = backend.artifact_forward(*(x.to(dev) for x in batch))
    c = compare((ref[0].float().cpu(), ref[1].float().cpu()), (got[0].float().cpu(), got[1].float().cpu()),
                batch, 0)
    backend.reset_stats()  # the smoke batch is not traffic
    worst = max(c["max_abs_option_prob"], c["max_abs_action_prob"])
    if not worst <= bound:
        return "it loaded but disagrees with the %s by %.3g (tolerance %.3g)" % (
            "build's eager fp32 reference" if record else "eager forward here", worst, bound)
    return None


def smoke_record_problem(record, vocab: int, art: Artifact) -> Optional[str]:
    """Why the manifest's smoke record must not be fed to the artifact (None: it may).

    Its structure (dtypes, shapes, marker positions inside the tokens, question types) was checked when
    the manifest was read; here: its hash (a record damaged or edited after the build, or written before
    records were hashed), token ids below this checkpoint's vocabulary, and the artifact's ranges."""
    from ..manifest import smoke_digest

    if record.sha256 is None:
        return "it has no sha256 (a bundle written before smoke records were hashed)"
    if smoke_digest(record) != record.sha256:
        return "its sha256 does not match its contents (damaged or edited after the build)"
    ids = record.inputs[0]
    top = max(max(row) for row in ids)
    if top >= vocab:
        return "token id %d is not below the checkpoint's vocabulary (%d)" % (top, vocab)
    r = art.ranges
    if r is None or r.out_of_range(len(ids[0]), len(record.inputs[2][0])):
        return "its batch is outside the artifact's exported ranges"
    return None


def _verify_here(agent, model, runner, art: Artifact, manifest: Bundle, machine,
                 stats: Dict[str, Any]) -> VerifyResult:
    """Full verification, on this machine, of an artifact the build had no GPU to verify (cross-compiled
    TileLang kernels). The verdict (with the bound it met, which the smoke check then applies) is cached
    per artifact and machine like the probe's."""
    import json as _json

    from ..files import write_json_atomic
    from ..probe import verdict_path
    from ..verification import EagerFigures, cases, decision_cases, reference_outputs, verify_runner

    path = verdict_path(art, machine, "verify:" + str(agent.device))
    try:
        cached = _json.loads(path.read_text(encoding="utf-8"))
        eager = cached.get("eager_in_dtype")
        decisions = cached.get("decisions")
        return VerifyResult(passed=cached["reason"] is None, reason=cached["reason"], tolerance=cached["tolerance"],
                            eager_in_dtype=Agreement(**eager) if eager else None, rule=cached.get("rule"),
                            decisions=DecisionAgreement(**decisions) if decisions else None)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    r = art.ranges
    pad_id = laya_api.pad_id(agent)
    t0 = time.perf_counter()
    seed, vocab, context, tol = int(time.time()), laya_api.vocab(agent), laya_api.context_len(agent), manifest.tolerance
    case_list = cases(seed, r, vocab, pad_id, context)
    with torch.no_grad(), torch.autocast(agent.device.type, enabled=False):
        references = reference_outputs(model, case_list)
        figures = EagerFigures(model, case_list, references, decision_cases(seed + 1, r, vocab, pad_id, context,
                                                                            tol.decisions), tol.decisions_alpha)
        eager = figures.get(art.dtype, str(agent.device))
        res = verify_runner(runner, model, case_list, r, pad_id, runner.device, rule_for(art.dtype, tol, eager),
                            references, eager, decisions=figures.decisions(runner, art.dtype, r, pad_id))
    stats["verify_here_s"] = round(time.perf_counter() - t0, 3)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"artifact": art.name, "reason": res.reason, "tolerance": res.tolerance,
                                 "rule": res.rule, "eager_in_dtype": dataclasses.asdict(eager) if eager else None,
                                 "decisions": dataclasses.asdict(res.decisions) if res.decisions else None,
                                 "figures": {"max_abs_option_prob": res.max_abs_option_prob,
                                             "max_abs_action_prob": res.max_abs_action_prob,
                                             "argmax_agreement": res.argmax_agreement}})
    except OSError:
        pass
    return res


def _graphs_wanted(asked: bool, art: Artifact, device: torch.device, probed: bool,
                   stats: Dict[str, Any]) -> bool:
    """CUDA graphs for a kind that replays them on CUDA, unless not asked for or the probe child's capture failed."""
    if not kinds.get(art.kind).cuda_graphs or device.type != "cuda":
        return False
    why = stats.get("probe_graphs") if probed else None
    stats["cuda_graphs"] = bool(asked and why is None)
    if asked and why is not None:
        stats["cuda_graphs_off"] = why
        log.warning("laya-aot: CUDA graphs off for %s: %s", art.name, why)
    return stats["cuda_graphs"]


def load(checkpoint: str, bundle: Optional[str | os.PathLike], device: Optional[str] = None,
         prefer: Optional[str] = None, strict: bool = False, probe: bool = True, smoke_check: bool = True,
         cuda_graphs: bool = True, bundle_sha256: Optional[str] = None,
         near_ties: bool | str = DEFAULT_NEAR_TIES, eager_module: str = "lazy", **agent_kwargs: Any):
    """A `laya.Agent` for `checkpoint` whose forward runs the best usable artifact of `bundle`.

    `prefer` asks for one artifact kind (tilelang, aoti, compile, onnx). `probe=False` skips the child
    process probe of native artifacts (only for machines where they are known to load).
    `cuda_graphs` replays small calls of a CUDA AOTInductor artifact as CUDA graphs (kinds.graphs),
    where the probe child captured one without trouble. `bundle_sha256` (or $LAYA_AOT_BUNDLE_SHA256) pins
    the bundle: the sha256 of its bundle.json, which lists every file's sha256 (`laya-aot inspect` prints
    it); another bundle is refused like any unusable one. `near_ties` ("off" by default: every answer is the
    artifact's, whose agreement with fp32 was measured against laya's own in the same dtype) can hand rows
    whose top two options are within the artifact's tie margin to laya's eager forward, for audits that need
    laya's bitwise outputs: "call" recomputes the whole call, "rows" only those rows (runtime/backend.py).
    `eager_module`: when laya's eager DecisionModel is built. "lazy" (default): only when something needs
    laya's eager forward (a request beyond the export, a near-tie mode, a fallback); "background": in a
    thread once the artifact serves; "now": as `laya.load` builds it, before anything else (also what
    `fast=`, `compile=` or `backend=` keyword arguments get). Other keyword arguments go to `laya.load`.
    `agent.backend` names what runs (`aot:aoti`, ...); `agent.backend_object` holds the artifact
    (`manifest.Artifact`), its variant, verify figures, `stats` and, for every artifact not used, the
    reason in `rejected`.
    """
    import laya

    t0 = time.perf_counter()
    if prefer is not None and prefer not in kinds.RUNTIME_ORDER:  # the caller's mistake, not the bundle's
        raise ValueError("prefer=%r is not an artifact kind; use one of %s" % (prefer, ", ".join(kinds.RUNTIME_ORDER)))
    near_ties = near_tie_mode(near_ties)
    if eager_module not in EAGER_MODULE_MODES:
        raise ValueError("eager_module=%r is not one of %s" % (eager_module, ", ".join(EAGER_MODULE_MODES)))
    ckpt = ckpt_mod.locate(str(checkpoint))
    pin = bundle_sha256 if bundle_sha256 is not None else (os.environ.get("LAYA_AOT_BUNDLE_SHA256") or None)
    bundle, not_fetched = resolve_for_load(bundle, device, ckpt)  # hf://, a pack, a dir of packs -> a local dir
    rejected: List[Tuple[str, str]] = [("bundle", not_fetched)] if not_fetched else []
    if bundle is None or not str(bundle):
        rejected.append(("bundle", "no bundle was given (bundle=%r); pass bundle=DIR, a directory written by "
                                   "`laya-aot build`" % (bundle,)))
    elif pin is not None and not _is_sha256(pin):
        rejected.append(("bundle", "the pin %r (bundle_sha256 or LAYA_AOT_BUNDLE_SHA256) is not a sha256 "
                                   "(64 hex digits); `laya-aot inspect BUNDLE` prints the bundle's" % str(pin)[:80]))
    usable = not rejected
    early = _Early(ckpt, Path(bundle), device, prefer, pin) if probe and usable else None
    # laya's own accelerations replace the forward themselves: those agents are built whole
    thin = usable and eager_module != "now" and not laya_api.accelerated(agent_kwargs)
    eager: Optional[EagerModule] = None
    try:
        if thin:
            agent = laya_api.thin_agent(str(ckpt), device=device, **agent_kwargs)
            eager = EagerModule(agent, ckpt)
        else:
            agent = laya.load(str(ckpt), device=device, **agent_kwargs)
        load_stats: Dict[str, Any] = {"agent_load_s": round(time.perf_counter() - t0, 3), "thin_agent": thin}
        chosen = None
        try:
            if usable:
                chosen = _choose(agent, ckpt, Path(bundle), prefer, probe, smoke_check, rejected, load_stats, early,
                                 cuda_graphs, pin, near_ties, eager)
        except BundleError as e:
            rejected.append(("bundle", str(e)))
        except Exception as e:  # noqa: BLE001 - nothing a bundle holds may take the service down: fall back
            log.warning("laya-aot: internal error while choosing an artifact of %s", bundle, exc_info=True)
            rejected.append(("bundle", "internal error in laya-aot (%s: %s); the bundle is not used, please "
                                       "report this" % (type(e).__name__, str(e)[:300])))
    finally:
        if early is not None:
            early.close()
    load_stats["select_s"] = round(time.perf_counter() - t0 - load_stats["agent_load_s"], 3)
    if chosen is not None:
        chosen.load_stats.update(load_stats)
        if chosen.eager_module is not None and (eager_module == "background" or near_ties != "off"):
            chosen.eager_module.start_background("eager_module=%r, near_ties=%r" % (eager_module, near_ties))
        return agent
    if strict:
        raise NoArtifactError("laya-aot: no artifact of %s can serve this agent: %s" % (bundle, _format(rejected)))
    warnings.warn("laya-aot: using laya's eager forward; no artifact of %s fits: %s" % (bundle, _format(rejected)),
                  RuntimeWarning, stacklevel=2)
    if eager is not None and laya_api.is_thin(agent):
        eager.install("no artifact of the bundle serves")
        load_stats.update(eager.stats)
    fallback = EagerFallback(agent, rejected)
    fallback.stats = load_stats
    laya_api.install_backend(agent, fallback)
    return agent


def _is_sha256(value: str) -> bool:
    v = str(value).strip().lower()
    return len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def _choose(agent, ckpt: Path, bundle: Path, prefer: Optional[str], probe: bool, smoke_check: bool,
            rejected: List[Tuple[str, str]], load_stats: Dict[str, Any],
            early: Optional[_Early] = None, cuda_graphs: bool = True, pin: Optional[str] = None,
            near_ties: str = DEFAULT_NEAR_TIES, eager: Optional[EagerModule] = None) -> Optional[AOTBackend]:
    from ..probe import finish
    from ..probe import probe as run_probe

    manifest = read_bundle(bundle, kinds.BY_NAME, sha256=pin)
    device = agent.device.type
    machine = current_machine(str(agent.device))
    if laya_api.parallel_options(agent):
        rejected.append(("bundle", "this checkpoint uses option_layout='parallel', which only laya's eager "
                                   "forward runs"))
        return None
    built_from = manifest.checkpoint.fingerprint.sha256
    t_fp = time.perf_counter()
    here = ckpt_mod.fingerprint(ckpt)["sha256"]
    load_stats["fingerprint_s"] = round(time.perf_counter() - t_fp, 3)
    if built_from != here:
        rejected.append(("bundle", "it was built from another checkpoint (fingerprint %s..., this checkpoint is "
                                   "%s...); its artifacts would give wrong answers: rebuild it with "
                                   "`laya-aot build checkpoint.path=%s`" % (built_from[:12], here[:12], ckpt)))
        return None
    candidates, skipped = rank(manifest.artifacts, device, prefer)
    rejected.extend(skipped)
    pad_id = laya_api.pad_id(agent)
    serving = laya_api.serving_dtype(agent)
    load_stats["serving_dtype"] = serving
    tensors = None
    for art in candidates:
        kind = kinds.get(art.kind)
        why = reject_reason(art, machine, device, serving)
        stats: Dict[str, Any] = {}
        if why is None:
            t_hash = time.perf_counter()
            why = check_artifact_hash(bundle, art)
            stats["hash_s"] = round(time.perf_counter() - t_hash, 3)
        if why is None and probe and kind.native:
            pending = early.take(art.name, str(agent.device)) if early is not None else None
            if pending is not None:
                stats["probe_overlapped_laya_load"] = True
                stats["probe_started_after_s"] = early.started_after_s
                t_wait = time.perf_counter()
                why = finish(pending, stats)
                stats["probe_wait_after_laya_load_s"] = round(time.perf_counter() - t_wait, 3)
            else:
                why = run_probe(bundle, art, ckpt, str(agent.device), machine, stats)
        if why is not None:
            rejected.append((art.name, why))
            continue
        try:
            thin = laya_api.is_thin(agent)
            if thin and kind.needs_module and eager is not None:
                eager.install("artifact %s runs laya's own module" % art.name)
                thin = False
            if tensors is None:  # a thin agent's artifact takes its weights from the checkpoint file
                tensors = ckpt_mod.Weights(ckpt) if thin else kinds.model_tensors(agent.model)
            env = kinds.LoadEnv(device=str(agent.device), tensors=tensors, model=agent.model, agent=agent,
                                cuda_graphs=_graphs_wanted(cuda_graphs, art, agent.device, probe, stats))
            t1 = time.perf_counter()
            runner = kind.load(artifact_path(bundle, art), art, env)
            stats["artifact_load_s"] = round(time.perf_counter() - t1, 3)
            backend = AOTBackend(agent, runner, art, pad_id, rejected, dict(load_stats, **stats), near_ties,
                                 eager if thin else None)
            if art.status == "unverified":  # verified here: the artifact now carries this machine's verdict
                model = eager.ensure("verifying %s here" % art.name) if thin and eager else agent.model
                here = _verify_here(agent, model, runner, art, manifest, machine, stats)
                why = None if here.passed else "verified on this machine and failed: %s" % here.reason
                art = dataclasses.replace(art, verify=here)
                backend.artifact, backend.verify = art, here
            if why is None and smoke_check:
                t_smoke = time.perf_counter()
                why = _smoke_check(agent, backend, art, manifest)
                stats["smoke_check_s"] = round(time.perf_counter() - t_smoke, 3)
        except Exception as e:  # noqa: BLE001 - any load failure means: try the next artifact
            why = "loading it failed: %s: %s" % (type(e).__name__, e)
        if why is not None:
            rejected.append((art.name, why))
            continue
        # the runner's own load figures, the checks after the backend was made (verify here, smoke check)
        # and, for the compile route, what the smoke check's first call cost
        stats.update(getattr(runner, "stats", None) or {})
        if eager is not None:
            stats.update(eager.stats)
        backend.load_stats.update(stats)
        laya_api.install_backend(agent, backend)
        margin = backend.tie_margin
        lat = art.latency_ms.get(device) or {}
        shapes = ", ".join("%s %.2f ms" % kv for kv in lat.items())
        why_first = ("chosen by its build latency on %s, %s (the lowest sum of those usable here)" % (device, shapes)
                     if lat else "no latency measured on %s: chosen by the kinds' order" % device)
        log.info("laya-aot: %s runs %s (%s; %s); %s; laya's eager module %s", ckpt, art.name, art.variant, why_first,
                 "every answer is the artifact's" if margin is None else
                 "rows whose top two options are within %.3g go to laya's eager forward (near_ties=%r)"
                 % (margin, near_ties),
                 "built" if backend.eager_module is None or backend.eager_module.model is not None else
                 "not built yet (the log says when and why it is)")
        return backend
    return None

"""`laya_aot.load`: a laya Agent whose forward is the best verified artifact this machine can run.

Checks run cheapest first, and nothing native is loaded until every earlier one passed: manifest
schema, checkpoint fingerprint, machine compatibility and build verification, sha256, a probe child
(native artifacts, once per machine), in-process load, a smoke comparison with the build's fp32
outputs, install. Each rejected artifact gets one reason; with none left the agent runs eager with one
warning listing them (`strict=True` raises). For the first candidate, the checks before the probe, the
probe itself (on stand-in weights), the weights' copy to the device and, once the probe passed, the load
run while laya builds the agent (`head_start.HeadStart`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch

from .. import checkpoint as ckpt_mod
from .. import kinds
from .. import laya_internals as laya_api
from ..bundle_format import artifact_path, check_artifact_hash, read_bundle
from ..distribution.fetch import resolve_for_load
from ..errors import LayaAotError
from ..manifest import Artifact, Bundle, BundleError, VerifyResult, is_sha256
from ..numerics.tolerance import Agreement, DecisionAgreement
from ..padding import CHUNK_TOKENS
from ..variant import current_machine
from . import host_path as host_path_mod
from . import start_costs
from .backend import DEFAULT_NEAR_TIES, AOTBackend, EagerFallback, near_tie_mode
from .eager_module import EagerModule
from .handover import Handover
from .head_start import HeadStart
from .select import plan, rank, reject_reason, start_tie_reason

log = logging.getLogger(__name__)


# when the loader builds laya's eager module (see `load`)
EAGER_MODULE_MODES = ("lazy", "background", "now")


class NoArtifactError(LayaAotError, RuntimeError):
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
    per artifact and machine like the probe's, and per checkpoint: the same kernels verify again against
    other weights."""
    from ..probe import verdict_path
    from ..verification import reference, verify_artifact

    path = verdict_path(art, machine, "verify:%s:%s" % (agent.device, manifest.checkpoint.fingerprint.sha256))
    cached = _cached_verdict(path, art)
    if cached is not None:
        return cached
    t0 = time.perf_counter()
    ref = reference(model, art.ranges, laya_api.vocab(agent), laya_api.pad_id(agent), int(time.time()),
                    manifest.tolerance, laya_api.context_len(agent))
    res = verify_artifact(runner, art.dtype, ref, str(agent.device))
    stats["verify_here_s"] = round(time.perf_counter() - t0, 3)
    _store_verdict(path, art, res)
    return res


def _cached_verdict(path: Path, art: Artifact) -> Optional[VerifyResult]:
    """The verdict `_store_verdict` wrote at `path` for `art` (None: none, or not one: `files.read_cache_json`, each
    figure typed as `_store_verdict` writes it, so no entry can hand the smoke check a bound that is not a number)."""
    from ..files import finite_number, read_cache_json

    def optional(check):
        return lambda v: v is None or check(v)

    def record(fields):
        return lambda v: isinstance(v, dict) and set(v) == set(fields) and all(fields[k](v[k]) for k in fields)

    agreement = {k: finite_number for k in ("max_abs_option_prob", "max_abs_action_prob", "argmax_agreement")}
    decisions = {"decisions": lambda v: type(v) is int and v > 0, "artifact": finite_number,
                 "eager_in_dtype": finite_number, "artifact_only_wrong": lambda v: type(v) is int and v >= 0,
                 "eager_only_wrong": lambda v: type(v) is int and v >= 0, "p_value": finite_number,
                 "alpha": finite_number, "test": lambda v: isinstance(v, str),
                 "gap": optional(finite_number), "compared_with": optional(lambda v: isinstance(v, str)),
                 "laya_serving": optional(finite_number)}
    decisions["near_ties"] = optional(lambda v: record(decisions)(v) and v["near_ties"] is None)

    def decided(v: Optional[dict]) -> Optional[DecisionAgreement]:
        return None if v is None else DecisionAgreement(**{**v, "near_ties": decided(v["near_ties"])})

    cached = read_cache_json(path, {"artifact": str, "reason": (str, type(None)), "rule": (str, type(None)),
                                    "tolerance": optional(lambda v: finite_number(v) and v >= 0),
                                    "eager_in_dtype": optional(record(agreement)),
                                    "decisions": optional(record(decisions)),
                                    "figures": record({k: optional(finite_number) for k in agreement})})
    if cached is None or cached["artifact"] != art.name or cached["reason"] is None and cached["tolerance"] is None:
        return None
    eager = cached["eager_in_dtype"]
    return VerifyResult(passed=cached["reason"] is None, reason=cached["reason"], tolerance=cached["tolerance"],
                        eager_in_dtype=Agreement(**eager) if eager else None, rule=cached["rule"],
                        decisions=decided(cached["decisions"]), **cached["figures"])


def _store_verdict(path: Path, art: Artifact, res: VerifyResult) -> None:
    """Cache a verdict of this machine's (best effort: a cache that cannot be written only costs a re-run)."""
    from ..files import write_json_atomic

    eager = res.eager_in_dtype
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


def _graphs_wanted(asked: bool, art: Artifact, device: torch.device, probed: bool,
                   stats: Dict[str, Any]) -> bool:
    """CUDA graphs for a kind that replays them on CUDA, unless not asked for or the probe child's capture failed."""
    if not kinds.get(art.kind).replays_graphs(str(device)):
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
         near_ties: bool | str = DEFAULT_NEAR_TIES, eager_module: str = "lazy", host_path: bool = True,
         chunk_tokens: int = CHUNK_TOKENS, handover: bool = True, **agent_kwargs: Any):
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
    `fast=`, `compile=` or `backend=` keyword arguments get). `host_path` (on by default, with an artifact
    serving): laya's tokenising with question heads kept across calls and a call's states tokenised in one
    batch, the same tokens as laya's (runtime/host_path.py). `chunk_tokens`: the most padded tokens one
    artifact call takes (a wider batch runs in even pieces, bounding the forward's activation memory; 0: only
    the export's max_rows splits). `handover` (on by default): where the artifact with the best measured mix
    runs laya's own module (built before its first answer: seconds) and another usable one does not, that one
    answers first and the best mix takes over once loaded and checked, in the
    background (runtime/handover.py; `select.plan`); False: the start waits for the best mix. Other keyword
    arguments go to `laya.load`.
    `agent.backend` names what runs (`aot:aoti`, ...); `agent.backend_object` holds the artifact
    (`manifest.Artifact`), its variant, verify figures, `stats` and, for every artifact not used, the
    reason in `rejected`.
    """
    t0 = time.perf_counter()
    near_ties = _checked_arguments(bundle, prefer, near_ties, eager_module, chunk_tokens)
    ckpt = ckpt_mod.locate(str(checkpoint))
    pin = bundle_sha256 if bundle_sha256 is not None else (os.environ.get("LAYA_AOT_BUNDLE_SHA256") or None)
    bundle, rejected = _local_bundle(bundle, device, ckpt, pin)
    usable = not rejected
    opts = _Options(prefer, probe, smoke_check, cuda_graphs, near_ties, chunk_tokens, bool(handover), pin is not None)
    # laya's own accelerations replace the forward themselves: those agents are built whole
    thin = usable and eager_module != "now" and not laya_api.accelerated(agent_kwargs)
    early = HeadStart(ckpt, Path(bundle), device, prefer, pin, thin, probe, cuda_graphs, bool(handover),
                      warm=not smoke_check) \
        if usable and (probe or thin) else None
    try:
        seed = _Seed(ckpt, Path(bundle), pin) if thin else None
        agent, eager = _agent(ckpt, device, thin, agent_kwargs, seed)
        load_stats: Dict[str, Any] = {"agent_load_s": round(time.perf_counter() - t0, 3), "thin_agent": thin}
        shipped = seed.wait() if seed is not None else None
        if shipped is not None:
            load_stats["tokenizer_snapshot"] = shipped
        chosen = _choose_or_fall_back(agent, ckpt, Path(bundle), opts, pin, rejected, load_stats, early, eager) \
            if usable else None
    finally:
        if early is not None:
            early.close()
        _end_probe_ahead()
    load_stats["select_s"] = round(time.perf_counter() - t0 - load_stats["agent_load_s"], 3)
    if chosen is not None:
        chosen.load_stats.update(load_stats)
        if host_path:
            chosen.host_path = host_path_mod.install(agent)
        _remember_start(agent, chosen)
        if chosen.eager_module is not None and (eager_module == "background" or near_ties != "off"):
            chosen.eager_module.start_background("eager_module=%r, near_ties=%r" % (eager_module, near_ties))
        if chosen.handover is not None:
            chosen.handover.start()
        return agent
    if strict:
        raise NoArtifactError("laya-aot: no artifact of %s can serve this agent: %s" % (bundle, _format(rejected)))
    warnings.warn("laya-aot: using laya's eager forward; no artifact of %s fits: %s" % (bundle, _format(rejected)),
                  RuntimeWarning, stacklevel=2)
    _install_fallback(agent, eager, rejected, load_stats)
    return agent


def _remember_start(agent, backend: AOTBackend) -> None:
    """What this start of the artifact cost, for the next start's ranking (`start_costs`): not a start that ran the
    probe child (paid once per machine), so the figures compare later starts with later starts."""
    stats = backend.load_stats
    if stats.get("probe") not in (None, "cached"):
        return
    start_costs.record(backend.artifact, current_machine(str(agent.device)), agent.device.type,
                       stats["agent_load_s"] + stats["select_s"])


def _end_probe_ahead() -> None:
    """A probe child started ahead for this load (`probe.start_ahead`) and not taken is ended with it."""
    from ..probe import end_ahead

    end_ahead()


class _Options(NamedTuple):
    """What the caller of `load` asked of the choice."""

    prefer: Optional[str]
    probe: bool
    smoke_check: bool
    cuda_graphs: bool
    near_ties: str
    chunk_tokens: int
    handover: bool = True
    pinned: bool = False  # bundle_sha256 given (and, past read_bundle, matched): a shipped probe verdict may serve


def _checked_arguments(bundle: Any, prefer: Optional[str], near_ties: bool | str, eager_module: str,
                       chunk_tokens: int) -> str:
    """The caller's mistakes (not the bundle's) raise TypeError or ValueError; returns the near-tie mode."""
    if bundle is not None and not isinstance(bundle, (str, os.PathLike)):
        raise TypeError("bundle=%s is not a path (its type is %s); pass bundle= a bundle directory (written by "
                        "`laya-aot build`), a pack, a directory of packs or an hf:// address, as a str or os.PathLike"
                        % (repr(bundle)[:60], type(bundle).__name__))
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 0:
        raise ValueError("chunk_tokens=%r is not a token count; use a whole number >= 0 (0: no token budget)"
                         % (chunk_tokens,))
    if prefer is not None and prefer not in kinds.RUNTIME_ORDER:
        raise ValueError("prefer=%r is not an artifact kind; use one of %s" % (prefer, ", ".join(kinds.RUNTIME_ORDER)))
    mode = near_tie_mode(near_ties)
    if eager_module not in EAGER_MODULE_MODES:
        raise ValueError("eager_module=%r is not one of %s" % (eager_module, ", ".join(EAGER_MODULE_MODES)))
    return mode


def _local_bundle(bundle: Any, device: Optional[str], ckpt: Path, pin: Optional[str]
                  ) -> Tuple[Any, List[Tuple[str, str]]]:
    """The bundle as a local directory (hf://, a pack, a directory of packs fetched or unpacked), and the
    reasons it cannot be used at all (no bundle, a fetch that failed, a pin that is not a sha256)."""
    bundle, not_fetched = resolve_for_load(bundle, device, ckpt)
    rejected: List[Tuple[str, str]] = [("bundle", not_fetched)] if not_fetched else []
    if bundle is None or not str(bundle):
        rejected.append(("bundle", "no bundle was given (bundle=%r); pass bundle=DIR, a directory written by "
                                   "`laya-aot build`" % (bundle,)))
    elif pin is not None and not is_sha256(str(pin).strip().lower()):
        rejected.append(("bundle", "the pin %r (bundle_sha256 or LAYA_AOT_BUNDLE_SHA256) is not a sha256 "
                                   "(64 hex digits); `laya-aot inspect BUNDLE` prints the bundle's" % str(pin)[:80]))
    return bundle, rejected


class _Seed:
    """The bundle's tokenizer snapshot into this machine's cache, where the cache lacks one (a first start here:
    without it the thin agent imports transformers to make one), and only once the bundle is accepted: the pin
    holds (the manifest is read under it) and it was built from this checkpoint (`checkpoint.mismatch`, whose
    digests the head start computes meanwhile). A refused bundle seeds nothing. The bundle is judged in a thread
    beside laya's imports; the thin agent waits for it just before it looks up its tokenizer (`wait`), and the
    snapshot is then checked against the checkpoint's tokenizer files like any cache entry
    (`tokenizer_snapshot.seed`). Never raises: `_choose` reads the bundle again and reports what is wrong with it."""

    def __init__(self, ckpt: Path, bundle: Path, pin: Optional[str]):
        from .. import tokenizer_snapshot

        self.said: Optional[str] = None  # what happened, for load_stats (None: the cache had one)
        self._tok_dir = str(ckpt / ckpt_mod.TOKENIZER_DIR)
        self._thread: Optional[threading.Thread] = None
        if not tokenizer_snapshot.cached(self._tok_dir):
            self._thread = threading.Thread(target=self._run, args=(ckpt, bundle, pin), daemon=True,
                                            name="laya-aot-tokenizer-seed")
            self._thread.start()

    def wait(self) -> Optional[str]:
        """Once the bundle is judged (and its snapshot seeded or not): what happened."""
        if self._thread is not None:
            self._thread.join()
        return self.said

    def _run(self, ckpt: Path, bundle: Path, pin: Optional[str]) -> None:
        try:
            self.said = self._seed(ckpt, bundle, pin)
        except Exception as e:  # noqa: BLE001 - reported by _choose's own read and checks
            self.said = "not read from the bundle (%s)" % type(e).__name__

    def _seed(self, ckpt: Path, bundle: Path, pin: Optional[str]) -> str:
        from .. import tokenizer_snapshot
        from ..manifest import text_digest

        manifest = read_bundle(bundle, kinds.BY_NAME, sha256=pin)
        snap = manifest.tokenizer_snapshot
        if snap is None:
            return "none in the bundle"
        if ckpt_mod.mismatch(manifest, ckpt) is not None:
            return "the bundle's not used: the bundle was not built from this checkpoint"
        if snap.sha256 != text_digest(snap.text):
            log.warning("laya-aot: the tokenizer snapshot in %s does not match its recorded sha256 (damaged or "
                        "edited); not used: this start loads laya's tokenizer itself", bundle)
            return "the bundle's did not match its sha256; not used"
        why = tokenizer_snapshot.seed(self._tok_dir, snap.key, snap.text)
        if why is not None:
            log.info("laya-aot: the bundle's tokenizer snapshot is not used here: %s", why)
            return "the bundle's not used: %s" % why
        return "the bundle's, stored in this machine's cache"


def _agent(ckpt: Path, device: Optional[str], thin: bool, agent_kwargs: Dict[str, Any], seed: Optional[_Seed] = None
           ) -> Tuple[Any, Optional[EagerModule]]:
    """laya's agent: thin (laya's module built on need, by the EagerModule returned with it) or whole."""
    if thin:
        agent = laya_api.thin_agent(str(ckpt), before_tokenizer=seed.wait if seed is not None else None,
                                    device=device, **agent_kwargs)
        eager = EagerModule(agent, ckpt)
        eager.guard_laya_switches()
        return agent, eager
    import laya

    return laya.load(str(ckpt), device=device, **agent_kwargs), None


def _install_fallback(agent, eager: Optional[EagerModule], rejected: List[Tuple[str, str]],
                      load_stats: Dict[str, Any]) -> None:
    """laya's eager forward serves: a thin agent gets laya's module first."""
    if eager is not None and laya_api.is_thin(agent):
        eager.install("no artifact of the bundle serves")
        load_stats.update(eager.stats)
    fallback = EagerFallback(agent, rejected)
    fallback.stats = load_stats
    laya_api.install_backend(agent, fallback)


def _choose_or_fall_back(agent, ckpt: Path, bundle: Path, opts: _Options, pin: Optional[str],
                         rejected: List[Tuple[str, str]], load_stats: Dict[str, Any], early: Optional[HeadStart],
                         eager: Optional[EagerModule]) -> Optional[AOTBackend]:
    """`_choose`, where any failure is one more reason in `rejected` (None): nothing a bundle holds may take
    the service down."""
    try:
        return _choose(agent, ckpt, bundle, opts, pin, rejected, load_stats, early, eager)
    except BundleError as e:
        rejected.append(("bundle", str(e)))
    except Exception as e:  # noqa: BLE001 - nothing a bundle holds may take the service down: fall back
        log.warning("laya-aot: internal error while choosing an artifact of %s", bundle, exc_info=True)
        rejected.append(("bundle", "internal error in laya-aot (%s: %s); the bundle is not used, please "
                                   "report this" % (type(e).__name__, str(e)[:300])))
    return None


def _choose(agent, ckpt: Path, bundle: Path, opts: _Options, pin: Optional[str], rejected: List[Tuple[str, str]],
            load_stats: Dict[str, Any], early: Optional[HeadStart],
            eager: Optional[EagerModule]) -> Optional[AOTBackend]:
    """The first artifact of `bundle` in the loader's order (`select.rank`) that passes every check, installed
    into `agent`; None when none does, each with its reason in `rejected`."""
    manifest = read_bundle(bundle, kinds.BY_NAME, sha256=pin)
    why = _bundle_refused(agent, manifest, ckpt, load_stats)
    if why is not None:
        rejected.append(("bundle", why))
        return None
    trial = _Trial(agent, ckpt, bundle, manifest, opts, rejected, load_stats, early, eager)
    device = agent.device.type
    starts = start_costs.known(manifest.artifacts, trial.machine, device)
    ranked, skipped = rank(manifest.artifacts, device, opts.prefer, starts)
    rejected.extend(skipped)
    load_stats["serving_dtype"] = laya_api.serving_dtype(agent)
    # the start's order among those that fit here (`select.plan`); the rest follow, each to get its reason
    fits = [a for a in ranked if reject_reason(a, trial.machine, device, load_stats["serving_dtype"]) is None]
    start = plan(fits, device, starts, opts.handover)
    for art in start.order + [a for a in ranked if all(a is not f for f in fits)]:
        backend = trial.run(art)
        if backend is not None:
            trial.drop_unused_module(backend)
            backend.load_stats["start_costs_here_s"] = starts
            if art is start.order[0] and start.why:
                why_first = start.why
            else:
                why_first = start_tie_reason(art, manifest.artifacts, device, starts)
            _log_choice(ckpt, backend, device, opts.near_ties, why_first)
            target = start.handover_to
            if target is not None and art is not target and all(name != target.name for name, _ in rejected):
                backend.handover = Handover(trial, target, backend, start.why)
            return backend
    return None


def _runs_module(art: Artifact) -> bool:
    """Whether the artifact runs laya's own module (its kind's `needs_module`): the agent then gets laya's module."""
    return kinds.get(art.kind).needs_module


def _bundle_refused(agent, manifest: Bundle, ckpt: Path, load_stats: Dict[str, Any]) -> Optional[str]:
    """Why no artifact of the bundle may serve this agent at all (None: each is judged on its own)."""
    if laya_api.parallel_options(agent):
        return "this checkpoint uses option_layout='parallel', which only laya's eager forward runs"
    t_fp = time.perf_counter()
    why = ckpt_mod.mismatch(manifest, ckpt)
    load_stats["fingerprint_s"] = round(time.perf_counter() - t_fp, 3)
    if why is not None:
        return ("%s; its artifacts would give wrong answers: rebuild it with `laya-aot build checkpoint.path=%s`"
                % (why, ckpt))
    return None


@contextlib.contextmanager
def _paused_serving(agent: Any, stats: Dict[str, Any]) -> Iterator[None]:
    """No forward of the agent runs inside (`laya_internals.serving_paused`): a hand-over's artifact makes its first
    calls here, which may capture CUDA graphs that a concurrent serving forward would break. The seconds from
    asking for the lock to releasing it add up in stats["serving_paused_s"]."""
    t0 = time.perf_counter()
    try:
        with laya_api.serving_paused(agent):
            yield
    finally:
        stats["serving_paused_s"] = round(stats.get("serving_paused_s", 0.0) + time.perf_counter() - t0, 3)


class _Trial:
    """The checks of one candidate artifact after another, cheapest first, sharing what they all need: the
    machine's facts, laya's serving dtype, the weights an artifact is loaded with."""

    def __init__(self, agent, ckpt: Path, bundle: Path, manifest: Bundle, opts: _Options,
                 rejected: List[Tuple[str, str]], load_stats: Dict[str, Any], early: Optional[HeadStart],
                 eager: Optional[EagerModule]):
        self.agent, self.ckpt, self.bundle, self.manifest, self.opts = agent, ckpt, bundle, manifest, opts
        self.rejected, self.load_stats, self.early, self.eager = rejected, load_stats, early, eager
        self.machine = current_machine(str(agent.device))
        self.pad_id = laya_api.pad_id(agent)
        self.tensors: Any = None
        self.module_for: Optional[str] = None  # the artifact laya's module was started for beside its probe
        self.last_reason: Optional[str] = None  # why the last artifact `run` tried was rejected
        self.stop: Optional[Any] = None  # a threading.Event a hand-over's owner sets to end it between its steps

    def _stopped(self) -> Optional[str]:
        """The reason to go no further, once `stop` is set (the process is exiting: runtime/handover.py)."""
        return "stopped: the process is exiting" if self.stop is not None and self.stop.is_set() else None

    def run(self, art: Artifact, handover: bool = False) -> Optional[AOTBackend]:
        """The artifact installed into the agent, or None with its reason added to `rejected` (and kept in
        `last_reason`). `handover`: another artifact serves meanwhile (runtime/handover.py), so laya's module,
        where this artifact runs it, is given to the agent only with this artifact's backend, and serving pauses
        while this artifact makes its first calls (verified here, smoke check: `_paused_serving`), as they may
        capture CUDA graphs in torch's global mode, which a concurrent serving forward would break."""
        stats: Dict[str, Any] = {}
        why = self._before_load(art, stats) or self._stopped()
        if why is None:
            try:
                backend, why = self._load(art, stats, handover)
            except Exception as e:  # noqa: BLE001 - any load failure means: try the next artifact
                why = "loading it failed: %s: %s" % (type(e).__name__, e)
        why = why or self._stopped()
        if why is not None:
            self.rejected.append((art.name, why))
            self.last_reason = why
            return None
        # the runner's own load figures, the checks after the backend was made (verify here, smoke check)
        # and, for the compile route, what the smoke check's first call cost
        stats.update(getattr(backend.runner, "stats", None) or {})
        if self.eager is not None:
            stats.update(self.eager.stats)
        backend.load_stats.update(stats)
        laya_api.install_backend(self.agent, backend)
        return backend

    def _before_load(self, art: Artifact, stats: Dict[str, Any]) -> Optional[str]:
        """The manifest's verdict for this machine, the files' hash, then the probe child (native kinds)."""
        why = reject_reason(art, self.machine, self.agent.device.type, self.load_stats["serving_dtype"])
        if why is None:
            t_hash = time.perf_counter()
            why = check_artifact_hash(self.bundle, art)
            stats["hash_s"] = round(time.perf_counter() - t_hash, 3)
        if why is None and self.opts.probe and kinds.get(art.kind).native:
            self._module_beside_probe(art)
            why = self._probe(art, stats)
        return why

    def _module_beside_probe(self, art: Artifact) -> None:
        """An artifact that runs laya's own module (`_runs_module`) waits for it to be built, seconds for a large
        checkpoint; its probe child, seconds on a first start, runs in another process meanwhile. So where a child
        will run (no verdict cached here), the module is built in a thread from here, and `_load` takes it once
        both are done; `drop_unused_module` discards it if another artifact serves."""
        from ..probe import cached_verdict

        if self.eager is None or not laya_api.is_thin(self.agent) or not _runs_module(art) \
                or cached_verdict(art, self.machine, str(self.agent.device), self.opts.pinned) is not None:
            return
        self.module_for = art.name
        self.eager.start_background("artifact %s runs laya's own module; built while its probe runs" % art.name)

    def drop_unused_module(self, served: AOTBackend) -> None:
        """A module built beside the probe of an artifact that was then rejected, where an artifact that does not
        run it serves (the agent still thin): discarded, as it would hold the weights again in fp32; built again
        on need. Kept where nothing serves (laya's eager forward takes it) or the served artifact runs it."""
        if self.module_for is None or self.eager is None or not laya_api.is_thin(self.agent):
            return
        self.eager.discard("artifact %s, which it was built for, was rejected; %s serves without it"
                           % (self.module_for, served.artifact.name))
        served.load_stats.update(self.eager.stats)

    def _probe(self, art: Artifact, stats: Dict[str, Any]) -> Optional[str]:
        """The probe child's verdict: the one started while laya loaded, when it was this artifact's."""
        from ..probe import probe as run_probe

        device = str(self.agent.device)
        t_wait = time.perf_counter()
        verdict = self.early.take_probe(art.name, device) if self.early is not None else None
        if verdict is None:
            return run_probe(self.bundle, art, self.ckpt, device, self.machine, stats, self.opts.pinned)
        why = verdict(stats)
        stats.update(probe_overlapped_laya_load=True, probe_started_after_s=self.early.started_after_s,
                     probe_wait_after_laya_load_s=round(time.perf_counter() - t_wait, 3))
        return why

    def _load(self, art: Artifact, stats: Dict[str, Any], handover: bool = False
              ) -> Tuple[AOTBackend, Optional[str]]:
        """Load it in this process, verify it here if the build could not, smoke-check it; why it fails."""
        agent, eager, kind = self.agent, self.eager, kinds.get(art.kind)
        thin = laya_api.is_thin(agent)
        model = agent.model
        if thin and _runs_module(art) and eager is not None:
            if handover:  # the serving artifact keeps the agent's model: this one takes laya's with its backend
                model = eager.ensure("artifact %s runs laya's own module; it takes over from the one serving"
                                     % art.name)
            else:
                eager.install("artifact %s runs laya's own module" % art.name)
                model = agent.model
            thin = False
        if self.tensors is None:  # a thin agent's artifact takes its weights from the checkpoint file
            self.tensors = ckpt_mod.Weights(self.ckpt) if thin else kinds.model_tensors(agent.model)
        graphs = _graphs_wanted(self.opts.cuda_graphs, art, agent.device, self.opts.probe, stats)
        if self._stopped():
            raise RuntimeError(self._stopped())
        t1 = time.perf_counter()
        runner = self._early_runner(art, thin, graphs, stats)
        if runner is None:
            env = kinds.LoadEnv(device=str(agent.device), tensors=self.tensors, model=model,
                                agent=agent if model is agent.model else laya_api.AgentWithModel(agent, model),
                                cuda_graphs=graphs, prepared=self._prepared(art, thin, stats))
            runner = kind.load(artifact_path(self.bundle, art), art, env)
        stats["artifact_load_s"] = round(time.perf_counter() - t1, 3)
        backend = AOTBackend(agent, runner, art, self.pad_id, self.rejected, dict(self.load_stats, **stats),
                             self.opts.near_ties, eager if thin else None, self.opts.chunk_tokens)
        backend.model = model  # the module it installs on; install_backend gives it to the agent with it
        why = None
        unverified = art.status == "unverified"
        # built before serving pauses, which it need not (seconds for a large checkpoint)
        reference = eager.ensure("verifying %s here" % art.name) if unverified and thin and eager else model
        with _paused_serving(agent, stats) if handover else contextlib.nullcontext():
            if unverified:  # verified here: the artifact now carries this machine's verdict
                here = _verify_here(agent, reference, runner, art, self.manifest, self.machine, stats)
                why = None if here.passed else "verified on this machine and failed: %s" % here.reason
                art = dataclasses.replace(art, verify=here)
                backend.artifact, backend.verify = art, here
            why = why or self._stopped()
            if why is None and self.opts.smoke_check:
                t_smoke = time.perf_counter()
                why = _smoke_check(agent, backend, art, self.manifest)
                stats["smoke_check_s"] = round(time.perf_counter() - t_smoke, 3)
        return backend, why


    def _early_runner(self, art: Artifact, thin: bool, graphs: bool, stats: Dict[str, Any]) -> Any:
        """The artifact as the head start loaded it while laya loaded (None: it did not, or not like this)."""
        if not thin or self.early is None:
            return None
        runner = self.early.take_runner(art.name, str(self.agent.device), graphs)
        if runner is not None:
            stats.update(self.early.stats, loaded_early=True)
        return runner

    def _prepared(self, art: Artifact, thin: bool, stats: Dict[str, Any]) -> Any:
        """The artifact's weights, put on the device while laya loaded (None: its load reads them now)."""
        if not thin or self.early is None:
            return None
        t = time.perf_counter()
        got = self.early.take_prepared(art.name, str(self.agent.device))
        if got is not None:
            stats.update(self.early.stats, weights_wait_after_laya_load_s=round(time.perf_counter() - t, 3))
        return got


def _log_choice(ckpt: Path, backend: AOTBackend, device: str, near_ties: str, start_tie: Optional[str] = None) -> None:
    """One log line: what serves, why it was tried first, who answers near-ties, whether laya's module exists."""
    art, margin = backend.artifact, backend.tie_margin
    lat = art.latency_ms.get(device) or {}
    shapes = ", ".join("%s %.2f ms" % kv for kv in lat.items())
    why_first = ("chosen by its build latency on %s, %s (%s)" % (
                     device, shapes, start_tie or "the lowest sum of those usable here")
                 if lat else "no latency measured on %s: chosen by the kinds' order" % device)
    log.info("laya-aot: %s runs %s (%s; %s); %s; laya's eager module %s", ckpt, art.name, art.variant, why_first,
             "every answer is the artifact's" if margin is None else
             "rows whose top two options are within %.3g go to laya's eager forward (near_ties=%r)"
             % (margin, near_ties),
             "built" if backend.eager_module is None or backend.eager_module.model is not None else
             "not built yet (the log says when and why it is)")

"""One candidate artifact's checks, cheapest first, until it serves or falls out with one reason (`Trial.run`).

The manifest's verdict for this machine (`usable.reject_reason`, through the load's `usable.Here`), the files'
hash, the probe child (native kinds; the head start's, where it started one for this artifact), the load in this
process (with the weights and the runner the head start prepared, where it did), verification here (an artifact
the build could not verify: cross-compiled TileLang), the smoke check against the build's fp32 record, then the
install into the agent. A hand-over (runtime/handover.py) runs the same checks on the best mix through the same
`Trial`, which is what it needs of it (`handover.HandoverTrial`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional, Tuple

import torch

from .. import checkpoint as ckpt_mod
from .. import kinds
from .. import laya_internals as laya_api
from ..bundle_format import artifact_path, check_artifact_hash
from ..manifest import Artifact, Bundle, VerifyResult
from ..numerics.tolerance import Agreement, DecisionAgreement
from .backend import AOTBackend

if TYPE_CHECKING:
    from ..kinds.usable import Here
    from .eager_module import EagerModule
    from .head_start import HeadStart, Taken
    from .session import LoadView

log = logging.getLogger(__name__)


def _smoke_check(agent, backend: AOTBackend, art: Artifact, manifest: Bundle) -> Optional[str]:
    """Run the installed artifact on one seeded batch and compare it with a reference (catches a bad load).

    The reference is the build's eager fp32 forward on that batch, stored in the manifest
    (verification.smoke_record), so a start does not also warm up and run the eager model; a bundle
    written before that record existed is compared with the eager forward here instead
    (`verification.smoke_disagreement`, given both forwards).
    """
    from ..verification import smoke_disagreement

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
    if not record and art.verify.eager_in_dtype is not None:
        # the eager forward here runs in the agent's own precision: it may itself be that far from fp32
        bound += art.verify.eager_in_dtype.worst
    worst = smoke_disagreement(record, art.ranges, vocab, backend.pad_id, backend.stock_forward,
                               backend.artifact_forward, agent.device)
    backend.reset_stats()  # the smoke batch is not traffic
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
    from ..files import write_cache_json

    eager = res.eager_in_dtype
    write_cache_json(path, {"artifact": art.name, "reason": res.reason, "tolerance": res.tolerance,
                            "rule": res.rule, "eager_in_dtype": dataclasses.asdict(eager) if eager else None,
                            "decisions": dataclasses.asdict(res.decisions) if res.decisions else None,
                            "figures": {"max_abs_option_prob": res.max_abs_option_prob,
                                        "max_abs_action_prob": res.max_abs_action_prob,
                                        "argmax_agreement": res.argmax_agreement}},
                     "every start verifies %s again" % art.name)


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


def _prepared(taken: Optional["Taken"], stats: Dict[str, Any]) -> Any:
    """The artifact's weights, put on the device while laya loaded (None: its load reads them now)."""
    if taken is None:
        return None
    t = time.perf_counter()
    got = taken.prepared()
    if got is not None:
        stats.update(taken.stats, weights_wait_after_laya_load_s=round(time.perf_counter() - t, 3))
    return got


def _runs_module(art: Artifact) -> bool:
    """Whether the artifact runs laya's own module (its kind's `needs_module`): the agent then gets laya's module."""
    return kinds.get(art.kind).needs_module


class Trial:
    """The checks of one candidate artifact after another, cheapest first, sharing what they all need: the load's
    session (its bundle, config, refusals and stats), the agent's facts here (`usable.Here`: device, machine,
    serving dtype), the weights an artifact is loaded with, what the head start did."""

    def __init__(self, session: "LoadView", here: "Here", agent: Any, eager: Optional["EagerModule"],
                 early: Optional["HeadStart"] = None):
        self.session, self.here, self.agent, self.eager, self.early = session, here, agent, eager, early
        self.bundle = session.bundle.path if session.bundle is not None else Path()
        self.pad_id = laya_api.pad_id(agent)
        self.tensors: Any = None
        self.module_for: Optional[str] = None  # the artifact laya's module was started for beside its probe
        self.last_reason: Optional[str] = None  # why the last artifact `run` tried was rejected
        self.stop: Optional[threading.Event] = None  # set by a hand-over's owner to end it between its steps

    def detach(self, stop: threading.Event) -> None:
        """For a hand-over after the start: the start's head start is closed (the hand-over makes its own checks),
        and `stop`, once set, ends the checks between their steps (the process is exiting)."""
        self.early = None
        self.stop = stop

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
        why, taken = self._before_load(art, stats)
        why = why or self._stopped()
        if why is None:
            try:
                backend, why = self._load(art, stats, taken, handover)
            except Exception as e:  # noqa: BLE001 - any load failure means: try the next artifact
                why = "loading it failed: %s: %s" % (type(e).__name__, e)
        why = why or self._stopped()
        if why is not None:
            self.session.rejected.append((art.name, why))
            self.last_reason = why
            return None
        # the runner's own load figures, the checks after the backend was made (verify here, smoke check)
        # and, for the compile route, what the smoke check's first call cost
        stats.update(getattr(backend.runner, "stats", None) or {})
        if self.eager is not None:
            stats.update(self.eager.stats)
        backend.load_stats.update(stats)
        laya_api.install_backend(self.agent, backend)
        if not handover and self.module_for is not None and self.eager is not None and laya_api.is_thin(self.agent):
            # a module built beside the probe of an artifact that was then rejected, where one that does not run it
            # serves (the agent still thin): discarded, as it would hold the weights again in fp32; built again on
            # need (kept where the served artifact runs it: the agent then has it)
            self.eager.discard("artifact %s, which it was built for, was rejected; %s serves without it"
                               % (self.module_for, art.name))
            backend.load_stats.update(self.eager.stats)
        return backend

    def _before_load(self, art: Artifact, stats: Dict[str, Any]) -> Tuple[Optional[str], Optional["Taken"]]:
        """The manifest's verdict for this machine, the files' hash, then the probe child (native kinds); and what
        the head start did for the artifact, taken once those cheap checks passed."""
        from ..probe import cached_verdict

        why = self.here.reject_reason(art)
        if why is None:
            t_hash = time.perf_counter()
            why = check_artifact_hash(self.bundle, art)
            stats["hash_s"] = round(time.perf_counter() - t_hash, 3)
        if why is not None:
            return why, None
        probed = self.session.config.probe and kinds.get(art.kind).native
        if (probed and self.eager is not None and laya_api.is_thin(self.agent) and _runs_module(art)
                and cached_verdict(art, self.here.machine, str(self.agent.device), self.session.pinned) is None):
            # laya's module, which this artifact runs, takes seconds to build for a large checkpoint; its probe
            # child (seconds, a first start: no verdict cached here) runs in another process meanwhile: the module
            # is built in a thread from here, `_load` takes it once both are done, `run` discards it if another
            # artifact serves
            self.module_for = art.name
            self.eager.start_background("artifact %s runs laya's own module; built while its probe runs" % art.name)
        taken = self.early.take(art.name, str(self.agent.device)) if self.early is not None else None
        return (self._probe(art, stats, taken) if probed else None), taken

    def _probe(self, art: Artifact, stats: Dict[str, Any], taken: Optional["Taken"]) -> Optional[str]:
        """The probe child's verdict: the one started while laya loaded, when it was this artifact's."""
        from ..probe import probe as run_probe

        if taken is None or taken.probe is None:
            return run_probe(self.bundle, art, self.session.ckpt, str(self.agent.device), self.here.machine, stats,
                             self.session.pinned)
        t_wait = time.perf_counter()
        why = taken.probe(stats)
        stats.update(probe_overlapped_laya_load=True, probe_started_after_s=taken.probe_started_after_s,
                     probe_wait_after_laya_load_s=round(taken.waited_s + time.perf_counter() - t_wait, 3))
        return why

    def _load(self, art: Artifact, stats: Dict[str, Any], taken: Optional["Taken"], handover: bool = False
              ) -> Tuple[AOTBackend, Optional[str]]:
        """Load it in this process (with what the head start did for it, `taken`, for a thin agent), verify it here
        if the build could not, smoke-check it; why it fails."""
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
            self.tensors = ckpt_mod.Weights(self.session.ckpt) if thin else kinds.model_tensors(agent.model)
        config = self.session.config
        graphs = _graphs_wanted(config.cuda_graphs, art, agent.device, config.probe, stats)
        if self._stopped():
            raise RuntimeError(self._stopped())
        t1 = time.perf_counter()
        taken = taken if thin else None  # a whole agent's artifact takes laya's module, not what was made early
        runner = taken.runner if taken is not None and taken.graphs == graphs else None
        if runner is not None:
            stats.update(taken.stats, loaded_early=True)
        else:
            env = kinds.LoadEnv(device=str(agent.device), tensors=self.tensors, model=model,
                                agent=agent if model is agent.model else laya_api.AgentWithModel(agent, model),
                                cuda_graphs=graphs, prepared=_prepared(taken, stats))
            runner = kind.load(artifact_path(self.bundle, art), art, env)
        stats["artifact_load_s"] = round(time.perf_counter() - t1, 3)
        backend = AOTBackend(agent, runner, art, self.pad_id, self.session.rejected,
                             dict(self.session.stats.as_dict(), **stats), config.near_ties, eager if thin else None,
                             config.chunk_tokens)
        backend.model = model  # the module it installs on; install_backend gives it to the agent with it
        why = None
        unverified = art.status == "unverified"
        # built before serving pauses, which it need not (seconds for a large checkpoint)
        reference = eager.ensure("verifying %s here" % art.name) if unverified and thin and eager else model
        with _paused_serving(agent, stats) if handover else contextlib.nullcontext():
            if unverified:  # verified here: the artifact now carries this machine's verdict
                here = _verify_here(agent, reference, runner, art, self.session.manifest, self.here.machine, stats)
                why = None if here.passed else "verified on this machine and failed: %s" % here.reason
                art = dataclasses.replace(art, verify=here)
                backend.artifact, backend.verify = art, here
            why = why or self._stopped()
            if why is None and config.smoke_check:
                t_smoke = time.perf_counter()
                why = _smoke_check(agent, backend, art, self.session.manifest)
                stats["smoke_check_s"] = round(time.perf_counter() - t_smoke, 3)
        return backend, why

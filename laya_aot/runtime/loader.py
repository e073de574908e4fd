"""`laya_aot.load`: a laya Agent whose forward is the best verified artifact this machine can run.

A load is one `LoadSession`, which owns its steps (`LoadSession.make_agent`) and calls out to leaves that take what they
need and never call back: the checks that need no heavy import first (the checkpoint's path, the bundle's bytes
under its pin, the small files of another checkpoint: `LoadSession.open`), so a wrong path, a missing bundle or
another checkpoint's bundle answers in well under a second, `strict` included. Then laya's agent
(`eager_module.laya_agent`) and, beside it, the head start (runtime/head_start.py: the load's start order, made once
by `select.select`, the first candidate's probe child, weights and load, the tokenizer's snapshot). Each candidate
in that order then goes through its checks, cheapest first (runtime/trial.py): manifest verdict for this machine,
sha256, probe child (native artifacts, once per machine), in-process load, a smoke comparison with the build's fp32
outputs, install. Each rejected artifact gets one reason; with none left the agent runs eager with one warning
listing them (`strict=True` raises). Importing this module imports no torch.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from .. import checkpoint as ckpt_mod
from ..manifest import Bundle, BundleError, is_sha256
from ..padding import CHUNK_TOKENS
from .session import (
    DEFAULT_NEAR_TIES,
    EAGER_MODULE_MODES,
    LoadArgumentTypeError,
    LoadConfig,
    LoadStats,
    NoArtifactError,
    OpenedBundle,
    _Once,
    config_of,
    no_artifact,
    reasons_of,
)

if TYPE_CHECKING:
    from ..kinds.usable import Here
    from .backend import AOTBackend
    from .eager_module import EagerModule
    from .head_start import HeadStart

__all__ = ["EAGER_MODULE_MODES", "LoadConfig", "LoadSession", "NoArtifactError", "load"]

log = logging.getLogger(__name__)


def load(checkpoint: str, bundle: Optional[str | os.PathLike], device: Optional[str] = None,
         prefer: Optional[str] = None, strict: bool = False, probe: bool = True, smoke_check: bool = True,
         cuda_graphs: bool = True, bundle_sha256: Optional[str] = None,
         near_ties: bool | str = DEFAULT_NEAR_TIES, eager_module: str = "lazy", host_path: bool = True,
         chunk_tokens: int = CHUNK_TOKENS, handover: bool = True, *, config: Optional[LoadConfig] = None,
         **agent_kwargs: Any):
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
    background (runtime/handover.py; `select.plan`); False: the start waits for the best mix. `config`: all of
    these as one `laya_aot.LoadConfig` instead (then none of them may be given). Other keyword arguments go to
    `laya.load`.
    `agent.backend` names what runs (`aot:aoti`, ...); `agent.backend_object` holds the artifact
    (`manifest.Artifact`), its variant, verify figures, `stats`, `load_stats` (what the load cost, and whose
    latencies ranked the artifacts: `ranking`) and, for every artifact not used, the reason in `rejected`.
    """
    t0 = time.perf_counter()
    cfg = config_of(config, device=device, prefer=prefer, strict=strict, probe=probe, smoke_check=smoke_check,
                    cuda_graphs=cuda_graphs, bundle_sha256=bundle_sha256, near_ties=near_ties,
                    eager_module=eager_module, host_path=host_path, chunk_tokens=chunk_tokens,
                    handover=handover).checked()
    from ..kinds.cpu_threads import settle

    settle()  # before torch is imported: CPU threads that do not collapse on a busy machine
    session = LoadSession.open(checkpoint, bundle, cfg)
    return session.make_agent(agent_kwargs, t0)


class LoadSession:
    """One call of `laya_aot.load`: the checkpoint, the bundle (None: none usable), the config, the reasons each
    artifact (or the whole bundle) was refused, the stats; the manifest, the start order and the fingerprint's
    verdict each made once for all who take part (the head start's threads, each candidate's checks, a hand-over:
    `session.LoadView` is what they read), and the load's steps (`make_agent`)."""

    def __init__(self, ckpt: Path, bundle: Optional[OpenedBundle], config: LoadConfig,
                 rejected: Optional[List[Tuple[str, str]]] = None, bundle_name: Any = None):
        self.ckpt = ckpt
        self.bundle = bundle
        self.bundle_name = bundle_name if bundle_name is not None else (bundle.path if bundle else None)
        self.config = config
        self.rejected: List[Tuple[str, str]] = list(rejected or [])
        self.stats = LoadStats()
        self.served_here: Optional["Here"] = None  # the facts the served artifact was chosen for (`_choose`)
        self._here: _Once[Any] = _Once(self._make_here)
        self._order: _Once[Any] = _Once(lambda: self._make_order(self.here()))
        self._mismatch: _Once[Optional[str]] = _Once(lambda: ckpt_mod.mismatch(self.manifest, self.ckpt))

    @classmethod
    def open(cls, checkpoint: str | os.PathLike, bundle: Any, config: LoadConfig) -> "LoadSession":
        """The checks that need no heavy import: the checkpoint's path (a CheckpointNotFound), the bundle's address
        (fetched or unpacked where it is one), its bytes under the pin, their JSON, and the small files of the
        checkpoint it records (a bundle of another architecture or tokenizer). What is wrong with the bundle is a
        reason in `rejected` (the caller falls back, or raises with `strict`)."""
        from ..distribution.fetch import resolve_for_load

        if bundle is not None and not isinstance(bundle, (str, os.PathLike)):
            raise LoadArgumentTypeError(
                "bundle=%s is not a path (its type is %s); pass bundle= a bundle directory (written by `laya-aot "
                "build`), a pack, a directory of packs or an hf:// address, as a str or os.PathLike"
                % (repr(bundle)[:60], type(bundle).__name__))
        ckpt = ckpt_mod.locate(str(checkpoint))
        pin = config.pin
        if bundle is None or not str(bundle):
            return cls(ckpt, None, config, [("bundle", "no bundle was given (bundle=%r); pass bundle=DIR, a "
                                                      "directory written by `laya-aot build`" % (bundle,))], bundle)
        if pin is not None and not is_sha256(str(pin).strip().lower()):
            return cls(ckpt, None, config, [("bundle", "the pin %r (bundle_sha256 or LAYA_AOT_BUNDLE_SHA256) is "
                                                       "not a sha256 (64 hex digits); `laya-aot inspect BUNDLE` "
                                                       "prints the bundle's" % str(pin)[:80])], bundle)
        local, not_fetched = resolve_for_load(bundle, config.device, ckpt)
        if not_fetched:
            return cls(ckpt, None, config, [("bundle", not_fetched)], bundle)
        try:
            opened = OpenedBundle(Path(local), pin)
        except BundleError as e:
            return cls(ckpt, None, config, [("bundle", str(e))], local)
        session = cls(ckpt, opened, config)
        eager_only = ckpt_mod.eager_only(ckpt)
        if eager_only:  # before the files' comparison: no rebuild can serve this checkpoint, its fix would mislead
            session.refuse(eager_only)
            return session
        recorded = opened.recorded_files()
        differ = ckpt_mod.differing_small_files(ckpt, recorded) if recorded else []
        if differ:
            session.refuse_other_checkpoint("it was built from another checkpoint than %s (differing: %s)"
                                            % (ckpt, ", ".join(differ[:5])))
        return session

    def refuse(self, why: str) -> None:
        """No artifact of the bundle may serve this agent: `why` is the bundle's reason."""
        self.rejected.append(("bundle", why))

    def refuse_other_checkpoint(self, why: str) -> None:
        """The bundle was not built from this checkpoint (`why`, in `checkpoint.mismatch`'s words): refused, with the
        fix."""
        self.refuse("%s; its artifacts would give wrong answers: rebuild it with `laya-aot build checkpoint.path=%s`"
                    % (why, self.ckpt))

    @property
    def usable(self) -> bool:
        """Whether the bundle may still serve (nothing refused it as a whole)."""
        return self.bundle is not None and not any(name == "bundle" for name, _ in self.rejected)

    @property
    def pinned(self) -> bool:
        """The pin held on the bytes the manifest was read from: a shipped probe verdict may serve."""
        return self.bundle is not None and self.bundle.pinned

    @property
    def manifest(self) -> Bundle:
        assert self.bundle is not None, "no bundle: nothing to read"
        return self.bundle.manifest

    def mismatch(self) -> Optional[str]:
        """`checkpoint.mismatch` of the manifest and the checkpoint, computed once (seconds for large weights never
        hashed here: the head start's thread asks first, beside laya's load)."""
        return self._mismatch.get()

    def _make_here(self) -> Any:
        from ..kinds.usable import here

        return here(ckpt_mod.read_config(self.ckpt), self.config.device)

    def here(self) -> Any:
        """`usable.Here` for this load (device, machine, serving dtype), from the checkpoint's config: what laya
        will serve in once the agent exists."""
        return self._here.get()

    def _make_order(self, here: Any) -> Any:
        from .select import select

        return select(self.manifest.artifacts, here, self.config.prefer, self.config.handover,
                      bundle_sha256=self.bundle.sha256 if self.bundle else None)

    def order(self, agent: Any = None) -> Any:
        """The start order (`select.select`), made once. Given the agent, its device and serving dtype must be those
        it was made for; should laya have chosen others, the order is made again for the agent's."""
        order = self._order.get()
        if agent is None:
            return order
        from .. import laya_internals as laya_api

        here = order.here
        serving = laya_api.serving_dtype(agent)
        if agent.device.type == here.device_type and serving == here.serving:
            return order
        from ..kinds.usable import Here
        from ..variant import current_machine

        log.info("laya-aot: laya serves %s in %s on %s, not %s on %s as its config said: the start order is made "
                 "for the agent", self.ckpt, serving, agent.device, here.serving, here.device)
        return self._make_order(Here(str(agent.device), agent.device.type, current_machine(str(agent.device)),
                                     serving))

    def reasons(self) -> str:
        """Every reason, one after another (for the warning or the error when nothing serves)."""
        return reasons_of(self.rejected)

    def make_agent(self, agent_kwargs: Dict[str, Any], t0: float) -> Any:
        """The agent, with the first artifact of the start order that passes every check, else laya's eager forward
        (at once, for a bundle refused as a whole): laya's agent with the head start beside it, the choice
        (`_choose`), then what follows it, each step a leaf that takes what it needs (the log line, laya's host path,
        the start's record, laya's module in the background, the hand-over, the artifacts this torch refuses) or
        the fall-back (`eager_module.serve_eager`)."""
        from ..probe import end_ahead, start_ahead

        cfg, usable = self.config, self.usable
        if not usable:
            end_ahead()  # a probe child started ahead has no artifact of this load to probe
            if cfg.strict:
                no_artifact(cfg.strict, self.bundle_name, self.rejected, stacklevel=3)  # before torch or laya
        elif cfg.probe:
            start_ahead()  # a first start's probe child imports torch beside this process (probe.py says when)
        from .. import laya_internals as laya_api
        from ..kinds.usable import warn_refused_for_software
        from . import host_path as host_path_mod
        from . import host_steps, start_costs
        from .eager_module import laya_agent, serve_eager
        from .head_start import HeadStart

        # laya's own accelerations replace the forward themselves: those agents are built whole, as is one that no
        # artifact may serve
        thin = usable and cfg.eager_module != "now" and not laya_api.accelerated(agent_kwargs)
        early = HeadStart(self, thin) if usable and (cfg.probe or thin) else None
        seed = early.seed if early is not None else None
        try:
            agent, eager = laya_agent(self.ckpt, cfg.device, thin, agent_kwargs,
                                      before_tokenizer=seed.wait if seed is not None else None)
            self.stats.agent_load_s = round(time.perf_counter() - t0, 3)
            self.stats.thin_agent = thin
            self.stats.tokenizer_snapshot = seed.wait() if seed is not None else self._snapshot_unused()
            if usable and cfg.host_path:
                host_steps.check_ahead(agent)
            chosen = self._choose_or_fall_back(agent, eager, early) if usable else None
        finally:
            if early is not None:
                early.close()
            end_ahead()  # a probe child started ahead for this load and not taken ends with it
        self.stats.select_s = round(time.perf_counter() - t0 - self.stats.agent_load_s, 3)
        if chosen is None:
            no_artifact(cfg.strict, self.bundle_name, self.rejected, stacklevel=3)  # make_agent, load, the caller
            serve_eager(agent, eager, self.rejected, self.stats)
            return agent
        # what follows the choice: the load's figures, laya's host path, the start's record (for the next start's
        # ranking), laya's module in the background where asked, the hand-over, the artifacts this torch refuses
        here = self.served_here
        chosen.load_stats.update(self.stats.as_dict())
        if cfg.host_path:
            chosen.host_path = host_path_mod.install(agent)
        stats = chosen.load_stats
        start_costs.record_start(chosen.artifact, here.machine, here.device_type,
                                 stats["agent_load_s"] + stats["select_s"], stats.get("probe"))
        if chosen.eager_module is not None and (cfg.eager_module == "background" or cfg.near_ties != "off"):
            chosen.eager_module.start_background("eager_module=%r, near_ties=%r" % (cfg.eager_module, cfg.near_ties))
        if chosen.handover is not None:
            chosen.handover.start()
        warn_refused_for_software(self.manifest.artifacts, here, self.bundle.sha256, self.bundle_name,
                                  chosen.artifact.name, {name for name, _ in self.rejected}, stacklevel=3)
        return agent

    def _snapshot_unused(self) -> Optional[str]:
        """Why a start that seeds nothing did not take the bundle's tokenizer snapshot (None: nothing to say)."""
        if self.usable or self.bundle is None or self.manifest.tokenizer_snapshot is None:
            return None
        return "the bundle's not used: the bundle was refused"

    def _choose_or_fall_back(self, agent: Any, eager: Optional["EagerModule"],
                             early: Optional["HeadStart"]) -> Optional["AOTBackend"]:
        """`_choose`, where any failure is one more reason in `rejected` (None): nothing a bundle holds may take
        the service down."""
        try:
            return self._choose(agent, eager, early)
        except BundleError as e:
            self.refuse(str(e))
        except Exception as e:  # noqa: BLE001 - nothing a bundle holds may take the service down: fall back
            log.warning("laya-aot: internal error while choosing an artifact of %s", self.bundle_name, exc_info=True)
            self.refuse("internal error in laya-aot (%s: %s); the bundle is not used, please report this"
                        % (type(e).__name__, str(e)[:300]))
        return None

    def _choose(self, agent: Any, eager: Optional["EagerModule"],
                early: Optional["HeadStart"]) -> Optional["AOTBackend"]:
        """The first artifact of the start order (`select.select`) that passes every check, installed into `agent`;
        None when none does, each with its reason in `rejected`. The order it was taken from is `served_here`'s."""
        from .handover import Handover
        from .trial import Trial

        t_fp = time.perf_counter()
        why = self.mismatch()
        self.stats.fingerprint_s = round(time.perf_counter() - t_fp, 3)
        if why is not None:  # no artifact of the bundle may serve this agent at all: the reason is the bundle's
            self.refuse_other_checkpoint(why)
            return None
        order = self.order(agent)
        self.served_here = order.here
        self.rejected.extend(order.skipped)
        self.stats.serving_dtype = order.here.serving
        self.stats.ranking = order.ranking
        self.stats.start_costs_here_s = order.starts
        tries = order.tries()
        trial = Trial(self, order.here, agent, eager, early)
        for art in tries:
            backend = trial.run(art)
            if backend is None:
                continue
            # one log line: what serves, why it was tried first, who answers near-ties, whether laya's module exists
            near = ("every answer is the artifact's" if backend.tie_margin is None else
                    "rows whose top two options are within %.3g go to laya's eager forward (near_ties=%r)"
                    % (backend.tie_margin, self.config.near_ties))
            module = backend.eager_module
            log.info("laya-aot: %s runs %s (%s; %s); %s; laya's eager module %s", self.ckpt, art.name,
                     art.variant, order.chosen_by(art, self.manifest.artifacts), near,
                     "built" if module is None or module.model is not None else
                     "not built yet (the log says when and why it is)")
            target = order.plan.handover_to
            if target is not None and art is not target and all(name != target.name for name, _ in self.rejected):
                backend.handover = Handover(trial, target, backend, order.plan.why)
            return backend
        return None


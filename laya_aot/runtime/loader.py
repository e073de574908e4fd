"""`laya_aot.load`: a laya Agent whose forward is the best verified artifact this machine can run.

A load is one `session.LoadSession`: the checks that need no heavy import first (the checkpoint's path, the
bundle's bytes under its pin, the small files of another checkpoint: `LoadSession.open`), so a wrong path, a missing
bundle or another checkpoint's bundle answers in well under a second, `strict` included. Then laya's agent and,
beside it, the head start (runtime/head_start.py: the load's start order, made once by `select.select`, the first
candidate's probe child, weights and load). Each candidate in that order then goes through its checks, cheapest
first (runtime/trial.py): manifest verdict for this machine, sha256, probe child (native artifacts, once per
machine), in-process load, a smoke comparison with the build's fp32 outputs, install. Each rejected artifact gets
one reason; with none left the agent runs eager with one warning listing them (`strict=True` raises). Importing
this module imports no torch.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from .. import checkpoint as ckpt_mod
from ..errors import LayaAotError
from ..manifest import BundleError
from ..padding import CHUNK_TOKENS
from .session import DEFAULT_NEAR_TIES, EAGER_MODULE_MODES, LoadConfig, LoadSession, config_of

if TYPE_CHECKING:
    from ..kinds.usable import Here
    from .backend import AOTBackend
    from .eager_module import EagerModule
    from .head_start import HeadStart

__all__ = ["EAGER_MODULE_MODES", "LoadConfig", "NoArtifactError", "load"]

log = logging.getLogger(__name__)


class NoArtifactError(LayaAotError, RuntimeError):
    """strict=True and no artifact of the bundle can serve this agent; the message lists every reason."""


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
    return _load(session, agent_kwargs, t0)


def _refused(session: LoadSession, stacklevel: int) -> None:
    """No artifact serves: `strict` raises NoArtifactError, otherwise one warning says laya's eager forward serves."""
    if session.config.strict:
        raise NoArtifactError("laya-aot: no artifact of %s can serve this agent: %s"
                              % (session.bundle_name, session.reasons()))
    warnings.warn("laya-aot: using laya's eager forward; no artifact of %s fits: %s"
                  % (session.bundle_name, session.reasons()), RuntimeWarning, stacklevel=stacklevel + 1)


def _load(session: LoadSession, agent_kwargs: Dict[str, Any], t0: float):
    """The agent, with the first artifact of the start order that passes every check, else laya's eager forward
    (at once, for a bundle refused as a whole)."""
    from ..probe import end_ahead, start_ahead

    cfg, usable = session.config, session.usable
    if not usable:
        end_ahead()  # a probe child started ahead has no artifact of this load to probe
        if cfg.strict:
            _refused(session, stacklevel=3)  # raised here, before torch or laya is imported
    elif cfg.probe:
        start_ahead()  # a first start's probe child imports torch beside this process (probe.py says when)
    from .. import laya_internals as laya_api
    from .head_start import HeadStart

    # laya's own accelerations replace the forward themselves: those agents are built whole, as is one that no
    # artifact may serve
    thin = usable and cfg.eager_module != "now" and not laya_api.accelerated(agent_kwargs)
    early = HeadStart(session, thin) if usable and (cfg.probe or thin) else None
    try:
        seed = _Seed(session) if thin else None
        agent, eager = _agent(session, thin, agent_kwargs, seed)
        session.stats.agent_load_s = round(time.perf_counter() - t0, 3)
        session.stats.thin_agent = thin
        session.stats.tokenizer_snapshot = seed.wait() if seed is not None else _snapshot_unused(session)
        chosen = _choose_or_fall_back(session, agent, eager, early) if usable else None
    finally:
        if early is not None:
            early.close()
        end_ahead()  # a probe child started ahead for this load and not taken ends with it
    session.stats.select_s = round(time.perf_counter() - t0 - session.stats.agent_load_s, 3)
    if chosen is None:
        _refused(session, stacklevel=3)  # _load, load, the caller
        _install_fallback(agent, eager, session)
        return agent
    _serve(session, agent, chosen)
    return agent


def _snapshot_unused(session: LoadSession) -> Optional[str]:
    """Why a start that seeds nothing did not take the bundle's tokenizer snapshot (None: nothing to say)."""
    if session.usable or session.bundle is None or session.manifest.tokenizer_snapshot is None:
        return None
    return "the bundle's not used: the bundle was refused"


def _serve(session: LoadSession, agent: Any, chosen: "AOTBackend") -> None:
    """What follows the choice: the load's figures, laya's host path, the start's record, laya's module in the
    background where asked, the hand-over, and the artifacts this torch refuses named once."""
    from . import host_path as host_path_mod
    from . import start_costs

    cfg = session.config
    here = session.order(agent).here
    chosen.load_stats.update(session.stats.as_dict())
    if cfg.host_path:
        chosen.host_path = host_path_mod.install(agent)
    stats = chosen.load_stats  # what this start cost, for the next start's ranking
    start_costs.record_start(chosen.artifact, here.machine, here.device_type,
                             stats["agent_load_s"] + stats["select_s"], stats.get("probe"))
    if chosen.eager_module is not None and (cfg.eager_module == "background" or cfg.near_ties != "off"):
        chosen.eager_module.start_background("eager_module=%r, near_ties=%r" % (cfg.eager_module, cfg.near_ties))
    if chosen.handover is not None:
        chosen.handover.start()
    _name_refused_for_software(session, agent, here)


_named_once: set = set()
_named_lock = threading.Lock()


def _name_refused_for_software(session: LoadSession, agent: Any, here: "Here") -> None:
    """Artifacts the load never examined (it stops at the first that serves) that would serve here with the build's
    software (`usable.refused_for_software`: another torch, ...): one warning per process for each, with the fix,
    as `laya-aot serve` names them in its log and `/v1/aot`."""
    from ..kinds.usable import refused_for_software

    examined = {agent.backend_object.artifact.name} | {name for name, _ in session.rejected}
    refused = [(n, why) for n, why in refused_for_software(
        [a for a in session.manifest.artifacts if a.name not in examined], here)
        if (session.bundle.sha256, n) not in _named_once]
    if not refused:
        return
    with _named_lock:
        _named_once.update((session.bundle.sha256, n) for n, _ in refused)
    warnings.warn("laya-aot: %s serves %s; refused for this process's software, though they could serve here: %s"
                  % (session.bundle_name, agent.backend_object.artifact.name,
                     "; ".join("%s: %s" % kv for kv in refused)), RuntimeWarning, stacklevel=5)  # the caller's line


class _Seed:
    """The bundle's tokenizer snapshot into this machine's cache, where the cache lacks one (a first start here:
    without it the thin agent imports transformers to make one), and only once the bundle is accepted: the pin
    holds (the manifest is read under it) and it was built from this checkpoint (`LoadSession.mismatch`, which the
    head start computes meanwhile). A refused bundle seeds nothing. The bundle is judged in a thread beside laya's
    imports; the thin agent waits for it just before it looks up its tokenizer (`wait`), and the snapshot is then
    checked against the checkpoint's tokenizer files like any cache entry (`tokenizer_snapshot.seed`). Never
    raises: the loader's own checks report what is wrong with the bundle."""

    def __init__(self, session: LoadSession):
        from .. import tokenizer_snapshot

        self.said: Optional[str] = None  # what happened, for load_stats (None: the cache had one)
        self._tok_dir = str(session.ckpt / ckpt_mod.TOKENIZER_DIR)
        self._thread: Optional[threading.Thread] = None
        if not tokenizer_snapshot.cached(self._tok_dir):
            self._thread = threading.Thread(target=self._run, args=(session,), daemon=True,
                                            name="laya-aot-tokenizer-seed")
            self._thread.start()

    def wait(self) -> Optional[str]:
        """Once the bundle is judged (and its snapshot seeded or not): what happened."""
        if self._thread is not None:
            self._thread.join()
        return self.said

    def _run(self, session: LoadSession) -> None:
        try:
            self.said = self._seed(session)
        except Exception as e:  # noqa: BLE001 - reported by the loader's own checks
            self.said = "not read from the bundle (%s)" % type(e).__name__

    def _seed(self, session: LoadSession) -> str:
        from .. import tokenizer_snapshot
        from ..manifest import text_digest

        snap = session.manifest.tokenizer_snapshot
        if snap is None:
            return "none in the bundle"
        if session.mismatch() is not None:
            return "the bundle's not used: the bundle was not built from this checkpoint"
        if snap.sha256 != text_digest(snap.text):
            log.warning("laya-aot: the tokenizer snapshot in %s does not match its recorded sha256 (damaged or "
                        "edited); not used: this start loads laya's tokenizer itself", session.bundle_name)
            return "the bundle's did not match its sha256; not used"
        why = tokenizer_snapshot.seed(self._tok_dir, snap.key, snap.text)
        if why is not None:
            log.info("laya-aot: the bundle's tokenizer snapshot is not used here: %s", why)
            return "the bundle's not used: %s" % why
        return "the bundle's, stored in this machine's cache"


def _agent(session: LoadSession, thin: bool, agent_kwargs: Dict[str, Any], seed: Optional[_Seed] = None
           ) -> Tuple[Any, Optional["EagerModule"]]:
    """laya's agent: thin (laya's module built on need, by the EagerModule returned with it) or whole."""
    ckpt, device = session.ckpt, session.config.device
    if thin:
        from .. import laya_internals as laya_api
        from .eager_module import EagerModule

        agent = laya_api.thin_agent(str(ckpt), before_tokenizer=seed.wait if seed is not None else None,
                                    device=device, **agent_kwargs)
        eager = EagerModule(agent, ckpt)
        eager.guard_laya_switches()
        return agent, eager
    import laya

    return laya.load(str(ckpt), device=device, **agent_kwargs), None


def _install_fallback(agent, eager: Optional["EagerModule"], session: LoadSession) -> None:
    """laya's eager forward serves: a thin agent gets laya's module first."""
    from .. import laya_internals as laya_api
    from .backend import EagerFallback

    if eager is not None and laya_api.is_thin(agent):
        eager.install("no artifact of the bundle serves")
        session.stats.extra.update(eager.stats)
    elif eager is None:  # a whole agent: laya built its module (a bundle refused before laya loaded, `now`, ...)
        session.stats.extra.setdefault("eager_module", "built")
    fallback = EagerFallback(agent, session.rejected)
    fallback.stats = session.stats.as_dict()
    laya_api.install_backend(agent, fallback)


def _choose_or_fall_back(session: LoadSession, agent: Any, eager: Optional["EagerModule"],
                         early: Optional["HeadStart"]) -> Optional["AOTBackend"]:
    """`_choose`, where any failure is one more reason in `rejected` (None): nothing a bundle holds may take
    the service down."""
    try:
        return _choose(session, agent, eager, early)
    except BundleError as e:
        session.refuse(str(e))
    except Exception as e:  # noqa: BLE001 - nothing a bundle holds may take the service down: fall back
        log.warning("laya-aot: internal error while choosing an artifact of %s", session.bundle_name, exc_info=True)
        session.refuse("internal error in laya-aot (%s: %s); the bundle is not used, please report this"
                       % (type(e).__name__, str(e)[:300]))
    return None


def _choose(session: LoadSession, agent: Any, eager: Optional["EagerModule"],
            early: Optional["HeadStart"]) -> Optional["AOTBackend"]:
    """The first artifact of the start order (`select.select`) that passes every check, installed into `agent`;
    None when none does, each with its reason in `session.rejected`."""
    from .handover import Handover
    from .trial import Trial

    if _bundle_refused(session, agent):
        return None
    order = session.order(agent)
    session.rejected.extend(order.skipped)
    session.stats.serving_dtype = order.here.serving
    session.stats.ranking = order.ranking
    session.stats.start_costs_here_s = order.starts
    trial = Trial(session, order.here, agent, eager, early)
    for art in order.tries():
        backend = trial.run(art)
        if backend is not None:
            trial.drop_unused_module(backend)
            # one log line: what serves, why it was tried first, who answers near-ties, whether laya's module exists
            near = ("every answer is the artifact's" if backend.tie_margin is None else
                    "rows whose top two options are within %.3g go to laya's eager forward (near_ties=%r)"
                    % (backend.tie_margin, session.config.near_ties))
            module = backend.eager_module
            log.info("laya-aot: %s runs %s (%s; %s); %s; laya's eager module %s", session.ckpt, art.name,
                     art.variant, order.chosen_by(art, session.manifest.artifacts), near,
                     "built" if module is None or module.model is not None else
                     "not built yet (the log says when and why it is)")
            target = order.plan.handover_to
            if target is not None and art is not target and all(name != target.name for name, _ in session.rejected):
                backend.handover = Handover(trial, target, backend, order.plan.why)
            return backend
    return None


def _bundle_refused(session: LoadSession, agent: Any) -> bool:
    """Whether no artifact of the bundle may serve this agent at all (the reason is then the bundle's)."""
    t_fp = time.perf_counter()
    why = session.mismatch()
    session.stats.fingerprint_s = round(time.perf_counter() - t_fp, 3)
    if why is not None:
        session.refuse_other_checkpoint(why)
    return why is not None

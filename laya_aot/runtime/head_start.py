"""A start's head start: what the loader does for its first candidate artifact while `laya.load` builds the agent.

A start's critical path is laya's agent (imports, config, tokenizer: about 2 s for a large checkpoint on
an H200) followed by the artifact (its probe child on a first start, its weights copied to the device,
its package loaded, its first call). Everything the artifact needs but the agent can run beside it, in
one thread, as long as it makes only the checks the loader makes first:

0. on a GPU, the process's CUDA context, in a thread of its own from the start (the order does not need it);
1. the load's start order (`LoadSession.order`: the manifest, read once, ranked and planned once, made here first),
   the first candidate's files' hash;
2. the probe child (native kinds), while the weights go to the device (`Kind.prepare`, thin agents; on a GPU
   only their tensors are made here, written once the artifact has them);
3. the checkpoint's fingerprint (`LoadSession.mismatch`), in a thread of its own (a mismatch kills the child and
   drops everything); for a thin agent, the bundle's tokenizer snapshot seeded into this machine's cache once the
   bundle is judged (`TokenizerSeed`, which the thin agent waits for before it looks up its tokenizer);
4. once the probe's verdict is that the artifact loads and runs here (or probing is off), the artifact
   itself: loaded with the prepared weights while the fingerprint is still being computed on a first start
   (nothing serves before the loader's trial has checked it). On a GPU the weights are handed over allocated but not yet
   written (`kinds.Incoming`), then written while the artifact makes its first call at the smoke check's shape
   (`LoadEnv.early_calls`: what a first call loads lazily, kernels and CUDA modules, paid beside the copy);
   elsewhere it is called once where the loader runs no smoke check (otherwise the smoke check's call is the
   first and pays that loading). Nothing native is loaded in this process before that verdict.

The loader's trial (runtime/trial.py) still makes every check in order and takes what was done here for the same
artifact on the same device (`take`, once, after its cheap checks); `close` drops what nobody took.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch

from .. import checkpoint as ckpt_mod
from .. import kinds, tokenizer_snapshot
from ..bundle_format import artifact_path, check_artifact_hash
from ..manifest import Artifact, text_digest
from ..padding import Batch, batch_of_shape, smallest_batch

if TYPE_CHECKING:
    from .session import LoadView

log = logging.getLogger(__name__)


@dataclass
class Taken:
    """What a head start did for the artifact a trial checks, handed over once (`HeadStart.take`)."""

    # waits for the probe child's verdict, adding its figures to the stats given (None: no probe started here)
    probe: Optional[Callable[[Dict[str, Any]], Optional[str]]]
    probe_started_after_s: Optional[float]  # from load() to the probe child's start
    waited_s: float                         # what `take` waited for the head start's thread
    runner: Any                             # the artifact loaded here (None: not loaded)
    graphs: Optional[bool]                  # whether it was loaded with CUDA graphs
    prepared: Callable[[], Any]             # waits for the weights put on the device here (None: none)
    stats: Dict[str, Any]                   # what was done here, for the load's stats


class HeadStart:
    """The first candidate artifact's checks, probe, weights and load, run beside laya's load (module doc)."""

    def __init__(self, session: "LoadView", thin: bool = False):
        self.name: Optional[str] = None      # the artifact worked on
        self.device: Optional[str] = None    # the device it was prepared for
        self.started_after_s: Optional[float] = None  # from load() to the probe child's start
        self.stats: Dict[str, Any] = {}      # what was done here, for the load's stats
        self._pending = None                 # a probe child started here, not finished
        self._verdict: Optional[Dict[str, Any]] = None  # a probe finished here: {"why": ..., "stats": {...}}
        self._prepared: Any = None
        self._runner: Any = None
        self._runner_graphs: Optional[bool] = None
        self._closed = threading.Event()
        self._t0 = time.perf_counter()
        self._weights_thread: Optional[threading.Thread] = None
        self._context_thread: Optional[threading.Thread] = None  # the CUDA context, made from the start
        self._mismatch = False               # the checkpoint is not the bundle's (`_fingerprint`)
        # call the artifact once after its load; not where the loader's smoke check calls it next anyway (that
        # call pays what a first call loads: a second forward in a row on the start's critical path saves nothing)
        self._warm = not session.config.smoke_check
        self._thread = threading.Thread(target=self._run, args=(session, thin), daemon=True,
                                        name="laya-aot-head-start")
        self._thread.start()
        self.seed = TokenizerSeed(session) if thin else None  # the tokenizer's snapshot, beside laya's imports

    def _since(self) -> float:
        return round(time.perf_counter() - self._t0, 3)

    def _run(self, session: "LoadView", thin: bool) -> None:
        from ..probe import begin

        try:
            config, bundle, ckpt = session.config, session.bundle.path, session.ckpt
            self._start_context(session.here().device)
            order = session.order()  # the load's one start order, made here first (laya's agent does not exist yet)
            here, art = order.here, order.first
            kind = kinds.get(art.kind) if art is not None else None
            probed = bool(kind and kind.native and config.probe)
            prepare = kind.prepare if kind is not None and thin else None
            ok = art is not None and (probed or prepare is not None) and check_artifact_hash(bundle, art) is None
            if ok:
                self.name, self.device = art.name, here.device
                if probed:
                    self.started_after_s = self._since()
                    self._pending = begin(bundle, art, ckpt, here.device, here.machine, pinned=session.pinned)
                if prepare is not None:
                    path = artifact_path(bundle, art)
                    self._weights_thread = threading.Thread(target=self._prepare, args=(prepare, path, ckpt),
                                                            daemon=True, name="laya-aot-head-start-weights")
                    self._weights_thread.start()
            # the fingerprint (seconds for a large checkpoint never seen here), beside the probe and the load
            # (`LoadSession.mismatch`: computed once, the loader waits for it); a mismatch kills the child
            fingerprint = threading.Thread(target=self._fingerprint, args=(session,), daemon=True,
                                           name="laya-aot-head-start-fingerprint")
            fingerprint.start()
            try:
                if ok and prepare is not None:
                    self._verdict_then_load(kind, art, bundle, ckpt, config.cuda_graphs, session.manifest.smoke)
            finally:
                fingerprint.join()
            if self._mismatch:
                self._drop()
        except Exception as e:  # noqa: BLE001 - the loader's trial repeats every check and reports it
            log.debug("head start stopped: %s", e)

    def _fingerprint(self, session: "LoadView") -> None:
        try:
            self._mismatch = session.mismatch() is not None
        except Exception as e:  # noqa: BLE001 - the loader checks it again and reports it
            log.debug("head start's fingerprint failed: %s", e)
            self._mismatch = True
        pending = self._pending
        if self._mismatch and pending is not None:
            pending.cancel()

    def _verdict_then_load(self, kind: Any, art: Artifact, bundle: Path, ckpt: Path, cuda_graphs: bool,
                           smoke: Any) -> None:
        """The probe's verdict (the artifact is loaded here only once a child loaded and ran it, or an earlier
        start or the build did), then the artifact itself."""
        from ..probe import finish

        graphs_ok: Optional[str] = None
        if self._pending is not None:
            pending, stats = self._pending, {}
            why = finish(pending, stats)
            self._verdict = {"why": why, "stats": stats, "done_after_s": self._since()}
            self._pending = None
            if why is not None:
                return
            graphs_ok = stats.get("probe_graphs")
        if self._mismatch or self._closed.is_set():
            return
        self._load(kind, art, artifact_path(bundle, art), ckpt,
                   cuda_graphs and kind.cuda_graphs and torch.device(self.device).type == "cuda"
                   and graphs_ok is None, smoke)

    def _start_context(self, device: str) -> None:
        """The process's CUDA context (part of every GPU start, about 0.1 s), made from the start in a thread of
        its own: the start order and the weights' tensors need not wait for it, nor it for them."""
        if torch.device(device).type != "cuda":
            return

        def make() -> None:
            t = time.perf_counter()
            try:
                torch.zeros(1, device=device)
                self.stats.update(cuda_context_s=round(time.perf_counter() - t, 3), cuda_context_after_s=self._since())
            except Exception as e:  # noqa: BLE001 - the weights' own allocation meets it again and reports it
                log.debug("no CUDA context made early on %s: %s", device, e)

        self._context_thread = threading.Thread(target=make, daemon=True, name="laya-aot-head-start-context")
        self._context_thread.start()

    def _prepare(self, prepare: Callable[..., Any], path: Path, ckpt: Path) -> None:
        t = time.perf_counter()
        try:
            if self._context_thread is not None:
                self._context_thread.join()
            # on a GPU only allocated here (`kinds.Incoming`): the artifact's load writes them once it has them
            self._prepared = prepare(path, ckpt_mod.Weights(ckpt), self.device)
            self.stats.update(weights_prepared_early_s=round(time.perf_counter() - t, 3),
                              weights_prepared_after_s=self._since())
        except Exception as e:  # noqa: BLE001 - the artifact's own load reads the weights again and reports it
            log.debug("weights not prepared early for %s: %s", self.name, e)

    def _load(self, kind: Any, art: Artifact, path: Path, ckpt: Path, graphs: bool, smoke: Any) -> None:
        """Load the artifact (its package loads while the weights are still on their way, takes them once
        allocated, and makes its first call while they are written where it can: `LoadEnv.early_calls`) and,
        unless the smoke check follows or that first call was made, call it once (its lazy loading paid here)."""
        if self._closed.is_set():
            return
        t = time.perf_counter()
        early = warm_batches(art, smoke) if torch.device(self.device).type == "cuda" else ()
        env = kinds.LoadEnv(device=self.device, tensors=ckpt_mod.Weights(ckpt), prepared=self._wait_prepared,
                            cuda_graphs=graphs, early_calls=early)
        runner = kind.load(path, art, env)
        t_warm = time.perf_counter()
        if self._warm and not isinstance(getattr(runner, "stats", {}).get("early_calls"), int):
            warm_up(runner, art)
            self.stats["warm_up_s"] = round(time.perf_counter() - t_warm, 3)
        if not self._closed.is_set():
            self._runner, self._runner_graphs = runner, graphs
            self.stats.update(loaded_early_s=round(time.perf_counter() - t, 3), loaded_early_after_s=self._since())

    def _wait_prepared(self) -> Any:
        """The prepared weights once their tensors exist (on a GPU not yet written: `kinds.Incoming`); None:
        weights inside the package, or not prepared."""
        if self._weights_thread is not None:
            self._weights_thread.join()
        prepared, self._prepared = self._prepared, None
        return prepared

    def take(self, name: str, device: str) -> Optional["Taken"]:
        """What was done here for artifact `name` on `device` (waiting for the thread), handed over once: the probe
        started here (the thread finishes it itself when it goes on to load the artifact), the runner loaded here
        and the weights prepared here; None when this head start worked on another artifact or device."""
        from ..probe import finish

        t = time.perf_counter()
        self._thread.join()
        if self.name != name or self.device != device:
            return None
        verdict = self._verdict
        probe: Optional[Callable[[Dict[str, Any]], Optional[str]]] = None
        if verdict is not None:
            def probe(stats: Dict[str, Any]) -> Optional[str]:
                stats.update(verdict["stats"], probe_done_after_s=verdict["done_after_s"])
                return verdict["why"]
        else:
            pending, self._pending = self._pending, None
            if pending is not None:
                def probe(stats: Dict[str, Any]) -> Optional[str]:
                    return finish(pending, stats)
        runner, self._runner = self._runner, None
        return Taken(probe, self.started_after_s, round(time.perf_counter() - t, 3), runner, self._runner_graphs,
                     self._take_prepared, self.stats)

    def _take_prepared(self) -> Any:
        """The weights prepared here (waiting for them), or None."""
        if self._weights_thread is not None:
            self._weights_thread.join()
        got, self._prepared = self._prepared, None
        return got

    def _drop(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        if self._weights_thread is not None:
            self._weights_thread.join()
        self._prepared = self._runner = None

    def close(self) -> None:
        """Stop and drop what nobody took (a probe child still running is killed, its verdict not cached)."""
        self._closed.set()
        if self._pending is not None:
            self._pending.cancel()
        self._thread.join()
        self._drop()


class TokenizerSeed:
    """The bundle's tokenizer snapshot into this machine's cache, where the cache lacks one (a first start here:
    without it the thin agent imports transformers to make one), and only once the bundle is accepted: the pin
    holds (the manifest is read under it) and it was built from this checkpoint (`LoadSession.mismatch`, which the
    head start computes meanwhile). A refused bundle seeds nothing. The bundle is judged in a thread beside laya's
    imports; the thin agent waits for it just before it looks up its tokenizer (`wait`), and the snapshot is then
    checked against the checkpoint's tokenizer files like any cache entry (`tokenizer_snapshot.seed`). Never
    raises: the loader's own checks report what is wrong with the bundle."""

    def __init__(self, session: "LoadView"):
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

    def _run(self, session: "LoadView") -> None:
        try:
            self.said = self._seed(session)
        except Exception as e:  # noqa: BLE001 - reported by the loader's own checks
            self.said = "not read from the bundle (%s)" % type(e).__name__

    def _seed(self, session: "LoadView") -> str:
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


def warm_batches(art: Artifact, smoke: Any) -> List[Batch]:
    """What a start calls the artifact with before it serves: one batch of the smoke record's padded shape (the
    call that follows; its values are not the record's, which the smoke check vets first: any ids in range do),
    or the smallest one the artifact takes."""
    if art.ranges is None:
        return []
    try:
        rows, tokens, markers = len(smoke.inputs[0]), len(smoke.inputs[0][0]), len(smoke.inputs[2][0])
        shaped = batch_of_shape(rows, art.ranges.padded_tokens(tokens), art.ranges.padded_markers(markers))
        if art.ranges.out_of_range(shaped[0].shape[1], markers) is None and rows <= art.ranges.max_rows:
            return [shaped]
    except (AttributeError, IndexError, TypeError, ValueError):  # no record, or not a well-formed one
        pass
    return [smallest_batch(art.ranges)]


def warm_up(runner: Any, art: Artifact) -> None:
    """One call of the artifact at its smallest shape: what its first call loads lazily (kernels, CUDA modules)."""
    if art.ranges is None:
        return
    with torch.no_grad():
        runner(*(x.to(runner.device) for x in smallest_batch(art.ranges)))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)

"""The hand-over: the artifact with the best measured mix takes over from the one that answered the start.

`select.plan` starts with a quicker-starting artifact where the best mix would make a start wait: an artifact
that runs laya's own module builds it first (transformers' model code imported, the module built and filled:
seconds for a large checkpoint). Once the quick one serves, a thread loads
the best mix with every check a start makes (hash, probe child, load, verification here where the build could
not, smoke check) and installs it under laya's write lock, with laya's module where it runs it
(`laya_internals.install_backend`): calls before that moment are the first artifact's, calls after it the new
one's, and none sees half of each. A hand-over that fails leaves the first artifact serving, with the reason in
the log and in `load_stats["handover"]`.

Serving pauses while the new artifact makes its first calls (its verification here and smoke check, under laya's
write lock: `trial._paused_serving`, recorded as `serving_paused_s`): they may capture CUDA graphs in torch's
global mode (laya's fast path, which the TileLang artifact drives), and a serving forward's allocation or
synchronising call on another thread during such a capture fails both.

A process that exits during a hand-over stops it at its next step and waits for the step under way (at most
EXIT_WAIT_S): a thread left inside torch or CUDA while the interpreter finalises can end the process badly.

It begins once the first artifact has answered its first call, or after IDLE_S without one: its first seconds
(transformers' imports, laya's module) hold the interpreter lock, and begun beside a start's first call they
made that answer 1.3 s later on an H200.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, Optional, Protocol

from ..manifest import Artifact
from . import start_costs

if TYPE_CHECKING:
    from ..kinds.usable import Here
    from .backend import AOTBackend
    from .eager_module import EagerModule

log = logging.getLogger(__name__)

IDLE_S = 2.0  # with no call this long after the start, the hand-over begins anyway
EXIT_WAIT_S = 60.0  # at exit, the longest wait for the step under way to end


class HandoverTrial(Protocol):
    """What a hand-over needs of the start's checks (runtime/trial.Trial): the agent, the machine it runs on (`here`,
    where its start's cost is recorded) and its eager module, the checks
    themselves (`run`, with serving paused where the new artifact makes its first calls) and why the last one failed,
    and `detach`: the start's head start dropped, and an event that ends the checks between their steps."""

    agent: Any
    here: "Here"
    eager: Optional["EagerModule"]
    last_reason: Optional[str]

    def run(self, art: Artifact, handover: bool = False) -> Optional["AOTBackend"]: ...

    def detach(self, stop: threading.Event) -> None: ...


class Handover:
    """One hand-over from the serving backend to `art` (module docstring); `stats` is the record of it, shared by
    both backends' `load_stats["handover"]`."""

    def __init__(self, trial: HandoverTrial, art: Artifact, served: "AOTBackend", why: Optional[str]):
        self.trial, self.art = trial, art
        self._served: Optional["AOTBackend"] = served
        self._done = threading.Event()
        self._begun = threading.Lock()  # taken once, by whichever comes first: the first answer or the timer
        self._timer: Optional[threading.Timer] = None
        self._stop = threading.Event()  # set at exit: the hand-over ends at its next step
        self._t0 = 0.0
        self.stats: Dict[str, Any] = {"from": served.artifact.name, "to": art.name, "why": why, "state": "waiting"}
        served.load_stats["handover"] = self.stats

    def start(self) -> None:
        """Arm it: it begins, in a daemon thread, after the serving backend's first call or IDLE_S without one."""
        self.trial.detach(self._stop)
        atexit.register(self._at_exit)
        self._served.after_first_call = self.begin
        self._timer = threading.Timer(IDLE_S, self.begin)
        self._timer.daemon = True
        self._timer.start()

    def begin(self) -> None:
        """Begin now (once; later calls do nothing)."""
        if self._stop.is_set() or not self._begun.acquire(blocking=False):
            return
        if self._timer is not None:
            self._timer.cancel()
        self.stats["state"] = "running"
        self._t0 = time.perf_counter()
        threading.Thread(target=self._run, daemon=True, name="laya-aot-handover").start()

    def _at_exit(self) -> None:
        self._stop.set()
        if self._timer is not None:
            self._timer.cancel()
        if self.stats.get("state") == "running":
            self._done.wait(EXIT_WAIT_S)

    def join(self, timeout: Optional[float] = None) -> bool:
        """Wait until the hand-over ended, either way; False if `timeout` passed first."""
        return self._done.wait(timeout)

    def _run(self) -> None:
        served, art, trial = self._served, self.art, self.trial
        try:
            backend = trial.run(art, handover=True)
            why = None if backend is not None else trial.last_reason
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the serving artifact keeps serving
            backend, why = None, "%s: %s" % (type(e).__name__, e)
        seconds = round(time.perf_counter() - self._t0, 3)
        served.after_first_call = None
        try:
            if backend is None:
                self._failed(served, why, seconds)
            else:
                self._done_with(served, backend, seconds)
        finally:
            self._served = None  # the replaced backend (and its runner's memory) is not held here
            self._done.set()
            atexit.unregister(self._at_exit)

    def _failed(self, served: Any, why: Optional[str], seconds: float) -> None:
        stopped = self._stop.is_set()
        self.stats.update(state="stopped" if stopped else "failed", reason=why, seconds=seconds)
        (log.info if stopped else log.warning)("laya-aot: %s keeps serving; the hand-over to %s %s after %.2f s: %s",
                                               served.artifact.name, self.art.name,
                                               "stopped" if stopped else "failed", seconds, why)
        eager = self.trial.eager
        # laya's module built for the hand-over holds the weights again: dropped unless the serving backend
        # wants laya's eager forward for near-ties (the agent still thin; a need later builds it again)
        if (eager is not None and eager.model is not None and served.near_ties == "off"
                and served.eager_module is eager and _thin(self.trial.agent)):
            eager.discard("the hand-over to %s, which it was built for, failed" % self.art.name)

    def _done_with(self, served: Any, backend: Any, seconds: float) -> None:
        self.stats.update(state="done", seconds=seconds, serving_paused_s=backend.load_stats.get("serving_paused_s"))
        backend.handover = self
        backend.host_path = served.host_path
        backend.load_stats["handover"] = self.stats
        stats, here = backend.load_stats, self.trial.here
        start_costs.record_start(self.art, here.machine, here.device_type,
                                 float(stats.get("agent_load_s", 0.0)) + seconds, stats.get("probe"))
        log.info("laya-aot: %s now serves in place of %s; the hand-over took %.2f s (serving paused %.3f s)",
                 self.art.name, served.artifact.name, seconds, self.stats["serving_paused_s"] or 0.0)


def _thin(agent: Any) -> bool:
    from .. import laya_internals as laya_api

    return laya_api.is_thin(agent)

"""laya's eager module for an agent loaded thin: built only when laya's eager forward is needed.

When an artifact serves, laya's own DecisionModel (built in fp32, filled with every weight, moved to the
device) is work the artifact replaces: seconds of every start for a large checkpoint. The loader makes the
agent with a meta-device shell instead (`laya_internals.thin_agent`) and hands this object to the backend.
Whatever needs laya's eager forward (a request beyond the export, a near-tie mode, a smoke check without a
stored reference, an artifact kind that runs laya's module itself, a fallback) calls `ensure`, which builds
the module once, says why in the log, and records it in `stats`.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import laya_internals as laya_api

log = logging.getLogger(__name__)


class EagerModule:
    """Builds laya's eager DecisionModel for a thin agent, once, on first need or in the background."""

    def __init__(self, agent: Any, checkpoint: Path):
        self.agent = agent
        self.checkpoint = Path(checkpoint)
        self.model: Optional[torch.nn.Module] = None
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self.stats: Dict[str, Any] = {"eager_module": "not built"}
        self._shell_in_retry: Optional[torch.nn.Module] = None   # the shell laya's retry replaced, until it ends
        self.retry_module: Optional[torch.nn.Module] = None      # laya's module on the CPU, for its next retry

    def ensure(self, why: str, device: Optional[torch.device] = None) -> torch.nn.Module:
        """The module, built now (blocking the caller) if nothing built it yet, on `device` (None: the agent's)."""
        model = self.model
        if model is not None:
            return model
        with self._lock:
            if self.model is None:
                t0 = time.perf_counter()
                log.info("laya-aot: building laya's eager module for %s (%s)", self.checkpoint, why)
                self.model = laya_api.build_eager_module(self.agent, str(self.checkpoint), device)
                self.stats.update(eager_module="built", eager_module_why=why,
                                  eager_module_s=round(time.perf_counter() - t0, 3))
            return self.model

    def start_background(self, why: str) -> None:
        """Build the module in a thread, so that whoever needs it later waits less or not at all (after the first
        answer, or while an artifact that runs the module is probed)."""
        if self.model is not None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._background, args=(why,), daemon=True,
                                        name="laya-aot-eager-module")
        self._thread.start()

    def _background(self, why: str) -> None:
        try:
            self.ensure(why + ", in the background")
        except Exception:  # noqa: BLE001 - a later need builds it again and raises there
            log.warning("laya-aot: building laya's eager module in the background failed", exc_info=True)

    def discard(self, why: str) -> None:
        """Drop the module (waiting for a background build to end): built for an artifact that does not serve,
        it would hold the weights again; whatever needs it later builds it again."""
        thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            self.model, self._thread = None, None
            self.stats.update(eager_module="discarded", eager_module_discarded_why=why)
        log.info("laya-aot: laya's eager module for %s discarded (%s)", self.checkpoint, why)

    def guard_laya_switches(self) -> None:
        """laya's `set_backend`, `accelerate` and `deaccelerate` run laya's own module once the artifact's backend
        is gone: on a thin agent each first gives the agent that module (built now if nothing built it), so that
        `agent.set_backend("eager")` serves laya's eager forward instead of failing on the shell of meta tensors
        ("Module [Module] is missing the required 'forward' function"). laya's retry of a request on the CPU after
        the GPU ran out of memory calls `deaccelerate` and moves the module to the CPU: on the shell that raised
        inside laya's retry and left the agent on the CPU with no backend, failing every later call. There the
        module is the one built on the CPU for laya's retries (`_for_layas_retry`), and when laya's retry ends the
        agent is thin again (`_after_layas_retry`). (laya-aot's own backend swaps, `laya_internals.install_backend`,
        call laya's `deaccelerate` itself, not this one.)"""
        laya_api.guard_laya_switches(self.agent, self._before, self._after_layas_retry)

    def _before(self, name: str, stock: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(stock)
        def with_laya_module(*args: Any, **kwargs: Any) -> Any:
            if laya_api.is_thin(self.agent):
                self.install("laya's %s was called" % name, for_layas_retry=name == "deaccelerate")
            return stock(*args, **kwargs)

        return with_laya_module

    def install(self, why: str, for_layas_retry: bool = False) -> None:
        """Make the built module the agent's own (for an artifact kind that runs it, or a fallback to eager);
        before any backend is installed. A module building in the background is waited for (`eager_module_wait_s`).
        `for_layas_retry` (laya's `deaccelerate`, which laya's retry after an out-of-memory calls holding its write
        lock, not re-entrant): the lock is not taken here, and the module is the one laya's retry runs on the CPU
        (`_for_layas_retry`) until the retry ends (`_after_layas_retry`)."""
        if for_layas_retry:
            self._shell_in_retry, self.agent.model = self.agent.model, self._for_layas_retry(why)
            return
        t0 = time.perf_counter()
        model = self.ensure(why)
        if self._thread is not None:
            self.stats["eager_module_wait_s"] = round(time.perf_counter() - t0, 3)
        laya_api.set_model(self.agent, model)

    def _for_layas_retry(self, why: str) -> torch.nn.Module:
        """laya's module for its retry on the CPU: the one an earlier retry left there, the one already built for
        the device (laya moves it), or one built on the CPU, where the retry runs it (a GPU that ran out of memory
        may have no room for it: on an H200 filled to 3 MB its build there ran out)."""
        if self.retry_module is None:
            self.retry_module = self.model if self.model is not None else self.ensure(
                why + "; built on the CPU for laya's retry there", device=torch.device("cpu"))
        return self.retry_module

    def _after_layas_retry(self, device: Any, dtype: Any, amp_enabled: bool) -> bool:
        """The end of laya's retry on the CPU (`laya_internals.guard_laya_switches`), which laya's own code ends by
        moving the agent's module back to the device: for a thin agent, the shell goes back instead (True: done
        here) and laya then installs the artifact's backend again, which needs none of laya's module. laya's move of
        its fp32 module would fail on a GPU still full (and leave the agent on the CPU, laya's eager forward serving
        every later call, as on an H200) or, with room, hold a second copy of the weights beside the artifact's for
        the life of the process. The module, on the CPU after the retry, is kept for laya's next retry
        (`retry_module`), so a GPU that stays full costs each call laya's CPU forward, not a new build. False: the
        agent had laya's module when the retry began, and laya's own end runs."""
        shell, self._shell_in_retry = self._shell_in_retry, None
        if shell is None:
            return False
        module, agent = self.agent.model, self.agent
        agent.model = shell
        agent.device, agent.dtype, agent.amp_enabled = device, dtype, amp_enabled
        with self._lock:
            if self.model is module:   # laya moved it to the CPU: whoever needs it on the device builds it again
                self.model = None
        self.retry_module = module
        self.stats.update(eager_module_kept_for_layas_retry=True,
                          layas_retries_ended=self.stats.get("layas_retries_ended", 0) + 1)
        log.warning("laya-aot: laya's retry on the CPU after an out-of-memory is over; the artifact serves %s "
                    "again on %s (laya's module kept on the CPU for its next retry)", self.checkpoint, device)
        return True


def laya_agent(checkpoint: Path, device: Optional[str], thin: bool, agent_kwargs: Dict[str, Any],
               before_tokenizer: Optional[Callable[[], Any]] = None) -> Tuple[Any, Optional[EagerModule]]:
    """laya's agent: thin (laya's module built on need, by the EagerModule returned with it) or whole."""
    if thin:
        agent = laya_api.thin_agent(str(checkpoint), before_tokenizer=before_tokenizer, device=device, **agent_kwargs)
        eager = EagerModule(agent, checkpoint)
        eager.guard_laya_switches()
        return agent, eager
    import laya

    return laya.load(str(checkpoint), device=device, **agent_kwargs), None


def serve_eager(agent: Any, eager: Optional[EagerModule], rejected: List[Tuple[str, str]], stats: Any) -> None:
    """laya's eager forward serves `agent` (no artifact does, each of `rejected` says why): a thin agent gets laya's
    module first, and the fall-back backend carries the load's `stats` (`session.LoadStats`)."""
    from .backend import EagerFallback

    if eager is not None and laya_api.is_thin(agent):
        eager.install("no artifact of the bundle serves")
        stats.extra.update(eager.stats)
    elif eager is None:  # a whole agent: laya built its module (a bundle refused before laya loaded, `now`, ...)
        stats.extra.setdefault("eager_module", "built")
    fallback = EagerFallback(agent, rejected)
    fallback.stats = stats.as_dict()
    laya_api.install_backend(agent, fallback)

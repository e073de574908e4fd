"""What `laya-aot bench` measures (runtime/bench.py keeps and reads the ranking): every artifact of a bundle that
can serve on this machine, loaded through the loader's own checks and timed here. Only the command imports it: it
takes the loader's agent and trial, which the ranking's reader (`bench.known`, asked by `select.select`) must not.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Tuple

from ..manifest import Artifact
from .bench import ROUNDS, WARMUP, Measured, threads, timed
from .loader import LoadSession

log = logging.getLogger(__name__)


def measure(session: "LoadSession", rounds: int = ROUNDS, warmup: int = WARMUP) -> Measured:
    """Every artifact of the session's bundle that fits here, loaded through the loader's own checks (a whole laya
    agent: runtime/trial.py) and all held at once, timed on its build's mix of shapes in interleaved rounds; those
    that fail a check, or were built without a mix on this device, are in `not_timed` with the reason."""
    import datetime

    from .. import laya_internals as laya_api
    from .eager_module import laya_agent
    from .trial import Trial

    agent, _ = laya_agent(session.ckpt, session.config.device, thin=False, agent_kwargs={})
    why = session.mismatch()
    if why is not None:
        session.refuse_other_checkpoint(why)
        raise ValueError(session.reasons())
    order = session.order(agent)
    trial = Trial(session, order.here, agent, None)
    runners: Dict[str, Tuple[Any, Artifact]] = {}
    shapes: Dict[str, List[str]] = {}
    not_timed: Dict[str, str] = {}
    for art in order.plan.order:
        mix = sorted(art.latency_ms.get(order.here.device_type) or {})
        if not mix:
            not_timed[art.name] = "its build measured no mix of shapes on %s" % order.here.device_type
            continue
        backend = trial.run(art)
        if backend is None:
            not_timed[art.name] = trial.last_reason or "it did not load"
            continue
        runners[art.name], shapes[art.name] = (backend.runner, art), mix
        log.info("laya-aot bench: %s loaded", art.name)
    if not runners:
        raise ValueError("no artifact of %s can be timed here: %s" % (session.bundle_name, "; ".join(
            "%s: %s" % kv for kv in not_timed.items()) or session.reasons()))
    figures, spread = timed(runners, shapes, laya_api.pad_id(agent), rounds, warmup)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return Measured(figures, spread, when, rounds, threads(), not_timed)

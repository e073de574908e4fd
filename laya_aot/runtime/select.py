"""Which of a bundle's artifacts this machine can run, in which order to try them, and why not the rest.

Every rejected artifact gets exactly one reason, phrased so an operator knows what to do about it.
Checks here read only the manifest and the machine's facts; hashing and probing (which touch the
artifact's bytes) come after, in `loader`.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from .. import kinds, precision
from ..manifest import Artifact
from ..variant import Machine, mismatch


def reject_reason(art: Artifact, machine: Machine, agent_device: str, serving_dtype: str) -> Optional[str]:
    """Why `art` cannot serve an agent on `agent_device` that laya runs in `serving_dtype`, from the manifest
    alone (None: it may)."""
    kind = kinds.get(art.kind)
    if not kind.serves:
        return "the portable %s is what the other artifacts are compiled from, not a runtime artifact" % kind.name
    if art.status == "build_failed":
        return "its build failed: %s" % art.error
    if art.status == "failed_verification":
        return "it failed verification at build time: %s" % (art.verify.reason if art.verify else None)
    if art.status == "unverified" and not kind.verified_at_build:
        pass  # cross-compiled without a GPU: the loader verifies it on this machine before using it
    elif art.status != "verified":
        why = (art.verify.reason if art.verify else None) or "status %r" % art.status
        return "it is not verified (%s)" % why
    refused = kind.refuse_device(agent_device)
    if refused:
        return refused
    if art.needs.device != agent_device:
        return "built for %s, the agent runs on %s" % (art.needs.device, agent_device)
    return mismatch(art.needs, machine) or precision.why_not(str(art.dtype), serving_dtype, agent_device)


def _latency(art: Artifact, device: str) -> Optional[float]:
    per_device = art.latency_ms.get(device) or {}
    return sum(per_device.values()) if per_device else None


def rank(arts: List[Artifact], device: str, prefer: Optional[str] = None
         ) -> Tuple[List[Artifact], List[Tuple[str, str]]]:
    """Candidates in the order to try them, and (name, reason) for those `prefer` rules out.

    Measured latency on this kind of device ranks first (fastest first); artifacts without a figure
    follow in the kinds' fixed order (`kinds.RUNTIME_ORDER`).
    """
    order = kinds.RUNTIME_ORDER
    skipped: List[Tuple[str, str]] = []
    pool = list(arts)
    if prefer:
        if prefer not in order:
            raise ValueError("prefer=%r is not an artifact kind; use one of %s" % (prefer, ", ".join(order)))
        skipped = [(a.name, "not the preferred kind (prefer=%r)" % prefer)
                   for a in pool if a.kind != prefer and a.kind in order]
        pool = [a for a in pool if a.kind == prefer]

    def key(a: Artifact):
        lat = _latency(a, device)
        rank_of_kind = order.index(a.kind) if a.kind in order else len(order)
        return (0, lat, rank_of_kind) if lat is not None else (1, rank_of_kind, 0.0)

    return sorted(pool, key=key), skipped

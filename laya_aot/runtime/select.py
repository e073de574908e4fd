"""Which of a bundle's artifacts this machine can run, in which order to try them, and why not the rest.

Every rejected artifact gets exactly one reason, phrased so an operator knows what to do about it.
Checks here (and in `usable.reject_reason`) read only the manifest and the machine's facts; hashing and
probing (which touch the artifact's bytes) come after, in `loader`.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from .. import kinds
from ..manifest import Artifact
from ..usable import reject_reason

__all__ = ["rank", "reject_reason"]  # reject_reason lives in ..usable: fetching asks it too


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

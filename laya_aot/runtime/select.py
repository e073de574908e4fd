"""Which of a bundle's artifacts this machine can run, in which order to try them, and why not the rest.

Every rejected artifact gets exactly one reason, phrased so an operator knows what to do about it.
Checks here (and in `usable.reject_reason`) read only the manifest and the machine's facts; hashing and
probing (which touch the artifact's bytes) come after, in `loader`.
"""
from __future__ import annotations

from typing import List, Mapping, Optional, Tuple

from .. import kinds
from ..manifest import Artifact
from ..usable import reject_reason

__all__ = ["MIX_TIE", "rank", "reject_reason"]  # reject_reason lives in ..usable: fetching asks it too

# artifacts whose measured mix is within this fraction of the fastest one's are a tie on the mix (a build's
# figures vary by a few percent from run to run): among them, the one that starts faster on this machine wins
MIX_TIE = 0.05


def _latency(art: Artifact, device: str) -> Optional[float]:
    per_device = art.latency_ms.get(device) or {}
    return sum(per_device.values()) if per_device else None


def rank(arts: List[Artifact], device: str, prefer: Optional[str] = None,
         starts: Optional[Mapping[str, float]] = None) -> Tuple[List[Artifact], List[Tuple[str, str]]]:
    """Candidates in the order to try them, and (name, reason) for those `prefer` rules out.

    The mix of shapes measured at build on this kind of device ranks first (fastest sum first); among those
    within MIX_TIE of the fastest, the one with the cheapest start recorded on this machine (`starts`, from
    `start_costs.known`) goes first. Artifacts without a figure follow in the kinds' fixed order
    (`kinds.RUNTIME_ORDER`).
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

    ordered = sorted(pool, key=key)
    measured = [a for a in ordered if _latency(a, device) is not None]
    if starts and len(measured) > 1:
        bound = _latency(measured[0], device) * (1 + MIX_TIE)
        tied = [a for a in measured if _latency(a, device) <= bound]
        tied.sort(key=lambda a: (starts.get(a.name, float("inf")), _latency(a, device)))
        ordered = tied + [a for a in ordered if all(a is not t for t in tied)]
    return ordered, skipped


def start_tie_reason(art: Artifact, arts: List[Artifact], device: str, starts: Mapping[str, float]) -> Optional[str]:
    """Why `art` went first on its start cost rather than its mix (None when the mix alone put it first)."""
    lat = _latency(art, device)
    faster = [a for a in arts if a is not art and _latency(a, device) is not None and lat is not None
              and _latency(a, device) < lat]
    if not faster or art.name not in starts:
        return None
    other = min(faster, key=lambda a: _latency(a, device))
    return ("within %d%% of %s's mix, and it starts faster here (%.2f s against %s)"
            % (round(MIX_TIE * 100), other.name, starts[art.name],
               "%.2f s" % starts[other.name] if other.name in starts else "no start recorded"))

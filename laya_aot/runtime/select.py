"""Which of a bundle's artifacts this machine can run, in which order to try them, and why not the rest.

Every rejected artifact gets exactly one reason, phrased so an operator knows what to do about it.
Checks here (and in `usable.reject_reason`) read only the manifest and the machine's facts; hashing and
probing (which touch the artifact's bytes) come after, in `loader`.
"""
from __future__ import annotations

from typing import List, Mapping, NamedTuple, Optional, Tuple

from .. import kinds
from ..kinds.usable import reject_reason
from ..manifest import Artifact

__all__ = ["MIX_TIE", "START_SLACK_S", "StartPlan", "plan", "rank", "reject_reason"]  # reject_reason: ..usable

# artifacts whose measured mix is within this fraction of the fastest one's are a tie on the mix (a build's
# figures vary by a few percent from run to run): among them, the one that starts faster on this machine wins
MIX_TIE = 0.05

# an artifact that runs laya's own module but is recorded as starting within this of a quicker one here serves a
# start itself: no hand-over (`plan`)
START_SLACK_S = 1.0


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


class StartPlan(NamedTuple):
    """The order in which a start tries the candidates, and the artifact that then takes over in the background."""

    order: List[Artifact]
    handover_to: Optional[Artifact]  # the best mix, when another artifact starts quicker here (None: none)
    why: Optional[str]               # why order[0] is not rank's first (None: it is)


def _starts_quicker(art: Artifact, best: Artifact, starts: Mapping[str, float]) -> Optional[str]:
    """Why `art` answers a start sooner than `best` (None: it does not): `best` runs laya's own module, which a start
    must build first (transformers' model code imported, the module made and filled: seconds for a large
    checkpoint), and `art` does not; unless both have a start recorded here and `best`'s is within START_SLACK_S of
    `art`'s. Recorded starts alone never make a hand-over: they vary with the machine's load from start to start."""
    if not kinds.get(best.kind).needs_module or kinds.get(art.kind).needs_module:
        return None
    if art.name in starts and best.name in starts:
        if starts[best.name] <= starts[art.name] + START_SLACK_S:
            return None
        return "%s runs laya's own module and started in %.2f s here, %s in %.2f s" % (
            best.name, starts[best.name], art.name, starts[art.name])
    return "%s runs laya's own module, which a start would build first; %s does not" % (best.name, art.name)


def plan(ranked: List[Artifact], device: str, starts: Optional[Mapping[str, float]] = None,
         handover: bool = True) -> StartPlan:
    """The start's order of `ranked` (`rank`'s order of the candidates that fit here): `rank`'s, except that a best
    mix which starts slowly is not what a start waits for.

    When another candidate starts quicker (`_starts_quicker`), that one is tried first and the best mix takes over
    once it is loaded and checked, in the background (runtime/handover.py): a service pays a start on every new
    replica and the call on every request, so the first answer comes from the quick starter and the rest from the
    best mix. Within MIX_TIE of the best mix the quick one simply serves. Should it fail to load, the start goes on
    down `rank`'s order. `handover=False`: `rank`'s order as it is."""
    order = list(ranked)
    if not handover or len(order) < 2:
        return StartPlan(order, None, None)
    best = order[0]
    for art in order[1:]:
        why = _starts_quicker(art, best, starts or {})
        if why:
            first = [art] + [a for a in order if a is not art]
            quick, slow = _latency(art, device), _latency(best, device)
            if quick is not None and slow is not None and quick <= slow * (1 + MIX_TIE):  # not worth a hand-over
                return StartPlan(first, None, "within %d%% of %s's mix, and it starts quicker here: %s"
                                 % (round(MIX_TIE * 100), best.name, why))
            return StartPlan(first, best, "it starts quicker here than %s, the best measured mix, which takes "
                                          "over once loaded: %s" % (best.name, why))
    return StartPlan(order, None, None)

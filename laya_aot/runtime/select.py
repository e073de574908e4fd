"""Which of a bundle's artifacts this machine can run, in which order to try them, and why not the rest.

`select` is the start order, written once: the start costs recorded here, the ranking (`rank`: the latencies
`laya-aot bench` measured on this machine where it ran, else the build's), what fits here (`usable.reject_reason`),
then the start's plan (`plan`: which one answers first, and a hand-over). The loader, its head start and `laya-aot
inspect` all take it from there. Every rejected artifact gets exactly one reason, phrased so an operator knows what
to do about it. Checks here read only the manifest, the machine's facts and this machine's cache; hashing and
probing (which touch the artifact's bytes) come after, in runtime/trial.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

from .. import kinds
from ..kinds.usable import Here, reject_reason
from ..manifest import Artifact

__all__ = ["MIX_TIE", "START_SLACK_S", "START_TIE", "StartOrder", "StartPlan", "plan", "rank",
           "reject_reason",  # kinds.usable's
           "select"]

# artifacts whose measured mix is within this fraction of the fastest one's are a tie on the mix (a build's
# figures vary by a few percent from run to run): among them, one that starts clearly faster here wins (START_TIE)
MIX_TIE = 0.05

# within the mix tie, a recorded start moves an artifact ahead of the one before it only when it is quicker than that
# one's recorded start by more than this fraction: recorded starts vary with the machine's load, and a tie-break
# that followed that noise switched a service's artifact from one start to the next (and two workers of one server
# could serve different ones)
START_TIE = 0.2

# an artifact that runs laya's own module but is recorded as starting within this of a quicker one here serves a
# start itself: no hand-over (`plan`)
START_SLACK_S = 1.0


def _build_latency(art: Artifact, device: str) -> Optional[float]:
    per_device = art.latency_ms.get(device) or {}
    return sum(per_device.values()) if per_device else None


def _latency(art: Artifact, device: str, here: Optional[Mapping[str, float]] = None) -> Optional[float]:
    """The sum the artifact is ranked by: measured on this machine (`here`) where given, else at build."""
    return here.get(art.name) if here else _build_latency(art, device)


def rank(arts: List[Artifact], device: str, prefer: Optional[str] = None,
         starts: Optional[Mapping[str, float]] = None, here: Optional[Mapping[str, float]] = None
         ) -> Tuple[List[Artifact], List[Tuple[str, str]]]:
    """Candidates in the order to try them, and (name, reason) for those `prefer` rules out.

    The mix of shapes measured on this kind of device ranks first (fastest sum first): measured on this machine
    (`here`, the sums `laya-aot bench` stored: runtime/bench.py) where given, else at build (`Artifact.latency_ms`);
    among those within MIX_TIE of the fastest, one whose start recorded on this machine (`starts`, from
    `start_costs.known`) is quicker by more than START_TIE goes first (`_start_leader`). Artifacts without a figure
    follow (those the build measured, by the build's figures, where `here` ranks the rest) in the kinds' fixed
    order (`kinds.RUNTIME_ORDER`).
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
        lat, built = _latency(a, device, here), _build_latency(a, device)
        rank_of_kind = order.index(a.kind) if a.kind in order else len(order)
        if lat is not None:
            return (0, lat, rank_of_kind)
        return (1, built, rank_of_kind) if here and built is not None else (2, rank_of_kind, 0.0)

    ordered = sorted(pool, key=key)
    measured = [a for a in ordered if _latency(a, device, here) is not None]
    if starts and len(measured) > 1:
        bound = _latency(measured[0], device, here) * (1 + MIX_TIE)
        lead = _start_leader([a for a in measured if _latency(a, device, here) <= bound], starts)
        ordered = [lead] + [a for a in ordered if a is not lead]
    return ordered, skipped


def _start_leader(tied: List[Artifact], starts: Mapping[str, float]) -> Artifact:
    """Of `tied` (in mix order), the one a start tries first: walking the mix order, an artifact takes the lead
    when its recorded start is quicker than the leader's by more than START_TIE (a leader never started here has
    none, so any recorded start is quicker). The same figures give the same leader, and the leader's own start
    recorded again a little slower, or a follower's a little quicker, does not change it."""
    lead = tied[0]
    for art in tied[1:]:
        if art.name in starts and starts[art.name] < starts.get(lead.name, float("inf")) * (1 - START_TIE):
            lead = art
    return lead


def start_tie_reason(art: Artifact, arts: List[Artifact], device: str, starts: Mapping[str, float],
                     here: Optional[Mapping[str, float]] = None) -> Optional[str]:
    """Why `art` went first on its start cost rather than its mix (None when the mix alone put it first)."""
    lat = _latency(art, device, here)
    faster = [a for a in arts if a is not art and _latency(a, device, here) is not None and lat is not None
              and _latency(a, device, here) < lat]
    if not faster or art.name not in starts:
        return None
    other = min(faster, key=lambda a: _latency(a, device, here))
    return ("within %d%% of %s's mix, and it starts more than %d%% faster here (%.2f s against %s)"
            % (round(MIX_TIE * 100), other.name, round(START_TIE * 100), starts[art.name],
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
         handover: bool = True, here: Optional[Mapping[str, float]] = None) -> StartPlan:
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
            quick, slow = _latency(art, device, here), _latency(best, device, here)
            if quick is not None and slow is not None and quick <= slow * (1 + MIX_TIE):  # not worth a hand-over
                return StartPlan(first, None, "within %d%% of %s's mix, and it starts quicker here: %s"
                                 % (round(MIX_TIE * 100), best.name, why))
            return StartPlan(first, best, "it starts quicker here than %s, the best measured mix, which takes "
                                          "over once loaded: %s" % (best.name, why))
    return StartPlan(order, None, None)


@dataclass(frozen=True)
class StartOrder:
    """A start's order of business (`select`): the facts it was made for, every candidate in `rank`'s order, those
    `prefer` ruled out, the plan of those that fit here, and whose latencies ranked them."""

    here: Here
    ranked: List[Artifact]
    skipped: List[Tuple[str, str]]
    plan: StartPlan
    starts: Dict[str, float]                     # start costs recorded here (`start_costs.known`)
    measured_here: Optional[Dict[str, Dict[str, float]]]  # `laya-aot bench`'s figures, by artifact and shape
    ranking: str                                 # "build" or what `laya-aot bench` measured here, and when

    @property
    def first(self) -> Optional[Artifact]:
        return self.plan.order[0] if self.plan.order else None

    def tries(self) -> List[Artifact]:
        """The plan's order, then every other candidate (each is tried to get its reason)."""
        return self.plan.order + [a for a in self.ranked if all(a is not f for f in self.plan.order)]

    def sums(self) -> Optional[Dict[str, float]]:
        """The mix's sum per artifact measured here (None: the build's figures rank)."""
        if self.measured_here is None:
            return None
        return {name: sum(shapes.values()) for name, shapes in self.measured_here.items()}

    def latencies(self, art: Artifact) -> Dict[str, float]:
        """The figures `art` was ranked by, per shape (empty: none)."""
        if self.measured_here is not None:
            return dict(self.measured_here.get(art.name) or {})
        return dict(art.latency_ms.get(self.here.device_type) or {})

    def chosen_by(self, art: Artifact, arts: List[Artifact]) -> str:
        """Why `art`, which serves, was the one tried first, in words: the figures it was ranked by and why it came
        before a faster mix (`why_first`), or the kinds' order where nothing was measured."""
        device = self.here.device_type
        lat = self.latencies(art)
        if not lat:
            return "no latency measured on %s: chosen by the kinds' order" % device
        whose = "its build latency" if self.ranking == "build" else "its latency %s" % self.ranking
        return "chosen by %s on %s, %s (%s)" % (whose, device, ", ".join("%s %.2f ms" % kv for kv in lat.items()),
                                               self.why_first(art, arts) or "the lowest sum of those usable here")

    def why_first(self, art: Artifact, arts: List[Artifact]) -> Optional[str]:
        """Why `art`, which serves, was tried before a faster mix (None: its mix put it first)."""
        if art is self.first and self.plan.why:
            return self.plan.why
        return start_tie_reason(art, arts, self.here.device_type, self.starts, self.sums())


def select(arts: List[Artifact], here: Here, prefer: Optional[str] = None, handover: bool = True,
           fits: Optional[Callable[[Artifact], bool]] = None, bundle_sha256: Optional[str] = None) -> StartOrder:
    """The start order of a bundle's artifacts on this machine, for an agent with the facts `here`: the one place
    it is made (module docstring). `fits`: which candidates may serve here (default: `here.reject_reason` finds
    nothing; `laya-aot inspect` also checks their files); `bundle_sha256`: the bundle's, whose ranking measured on
    this machine by `laya-aot bench` is taken where one is stored (`bench.known`)."""
    from . import bench, start_costs

    device = here.device_type
    fits = fits or (lambda a: here.reject_reason(a) is None)
    measured = bench.known(bundle_sha256, arts, here) if bundle_sha256 else None
    sums = None if measured is None else {n: sum(shapes.values()) for n, shapes in measured.figures.items()}
    starts = start_costs.known(arts, here.machine, device)
    ranked, skipped = rank(arts, device, prefer, starts, sums)
    start = plan([a for a in ranked if fits(a)], device, starts, handover, sums)
    return StartOrder(here, ranked, skipped, start, starts, measured.figures if measured else None,
                      measured.describe() if measured else "build")

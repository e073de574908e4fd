"""The latencies the loader ranks by are timed in interleaved rounds (`verification.interleaved_ms`, used by the
build and by `laya-aot bench`): a burst of other work on the machine slows every artifact alike, so it cannot
reorder them, where timing one artifact after another let it fall on one of them."""
from __future__ import annotations

from laya_aot import verification


class Machine:
    """A fake clock: each call costs its artifact's own time, plus `burst` ms while the machine is busy (the first
    `busy_ms` of the run)."""

    def __init__(self, busy_ms: float, burst: float):
        self.now, self.busy_ms, self.burst = 0.0, busy_ms, burst

    def clock(self) -> float:
        return self.now / 1e3

    def call(self, cost: float):
        return lambda: setattr(self, "now", self.now + cost + (self.burst if self.now < self.busy_ms else 0.0))


COST = {"fast": 10.0, "slow": 12.0}


def test_a_burst_of_other_work_does_not_reorder_interleaved_artifacts(monkeypatch):
    m = Machine(busy_ms=250.0, burst=30.0)  # busy for the warm-up and the first timed rounds
    monkeypatch.setattr(verification.time, "perf_counter", m.clock)
    calls = [(name, "1x128x4", m.call(cost), None) for name, cost in COST.items()]
    medians, spread = verification.interleaved_ms(calls, rounds=9, warmup=2)
    assert medians == {"fast": {"1x128x4": 10.0}, "slow": {"1x128x4": 12.0}}
    assert spread["fast"]["1x128x4"] == 30.0  # the burst shows as spread, not in the median


def test_timed_one_after_another_the_same_burst_reorders_them(monkeypatch):
    """What the build did before: each artifact's calls in a row (`latency_ms`), the faster one first."""
    m = Machine(busy_ms=250.0, burst=30.0)
    monkeypatch.setattr(verification.time, "perf_counter", m.clock)
    one_by_one = {name: verification.latency_ms(m.call(cost), 9) for name, cost in COST.items()}
    assert one_by_one["fast"] > one_by_one["slow"]

"""CUDA graph policy of the AOTInductor runner (runtime.graphs), with a stand-in graph: CI has no GPU.

What a real capture does on the H200 is measured by benchmarks/gpu_bench.py; here: which calls are
captured, that replays serve later calls, that a failed or disagreeing capture leaves plain calls.
"""
from __future__ import annotations

import torch

from laya_aot.kinds.graphs import GraphedCalls


class FakeGraph:
    """Records the captured call; replay runs the function on copies of the new inputs."""

    made = 0

    def __init__(self, fn, inputs, pool, offset=0.0):
        FakeGraph.made += 1
        self.fn, self.offset, self.replays = fn, offset, 0

    def replay(self, inputs, out_device=None):
        self.replays += 1
        return [(o + self.offset).to(out_device or o.device) for o in self.fn(*inputs)]

    def pool(self):
        return "pool"


def _fn(calls):
    def fn(ids, att):
        calls.append(tuple(ids.shape))
        return (ids.float().sum(1, keepdim=True) * 2, att.float().mean(1))
    return fn


def _inputs(rows, tokens, value=1):
    return torch.full((rows, tokens), value), torch.ones((rows, tokens), dtype=torch.long)


def test_second_call_of_a_small_shape_is_captured_and_then_replayed():
    calls = []
    g = GraphedCalls(_fn(calls), max_tokens=256, graph_factory=FakeGraph)
    first = g(*_inputs(1, 128))
    assert g.stats == {"graphs": 0, "plain_rare": 1}
    second = g(*_inputs(1, 128))
    assert g.stats["captured"] == 1 and g.stats["graphs"] == 1
    third = g(*_inputs(1, 128, value=3))   # new values, same shape: a replay on the new inputs
    assert g.stats["replays"] == 1
    assert torch.equal(first[0], second[0]) and torch.equal(third[0], torch.full((1, 1), 768.0))


def test_large_shapes_are_never_captured():
    g = GraphedCalls(_fn([]), max_tokens=256, graph_factory=FakeGraph)
    for _ in range(3):
        g(*_inputs(4, 128))          # 512 tokens > 256
    assert g.stats == {"graphs": 0, "plain_large": 3}


def test_a_failing_capture_leaves_plain_calls_and_says_why():
    def broken(fn, inputs, pool):
        raise RuntimeError("operation not permitted when stream is capturing")
    calls = []
    g = GraphedCalls(_fn(calls), graph_factory=broken)
    outs = [g(*_inputs(2, 16)) for _ in range(4)]
    assert all(torch.equal(o[0], outs[0][0]) for o in outs)
    assert len(calls) == 4                                       # every call ran the function itself
    assert "operation not permitted" in g.stats["refused"]["2x16"]
    assert g.stats["refusals"] == 1                               # tried once, not on every call


def test_a_capture_out_of_memory_is_tried_again_later_then_given_up():
    """Memory short at a capture (a GPU shared with another process, as an H200 was) may be
    short only for now: the shape is captured again after two more calls, up to three captures in all, instead
    of running plain calls for the rest of the process."""
    tries = []

    def short_twice(fn, inputs, pool):
        tries.append(1)
        if len(tries) <= 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 86.00 MiB")
        return FakeGraph(fn, inputs, pool)

    g = GraphedCalls(_fn([]), graph_factory=short_twice)
    for _ in range(2):
        g(*_inputs(2, 16))
    assert len(tries) == 1 and "refused" not in g.stats and g.stats["capture_out_of_memory"] == 1
    for _ in range(4):
        g(*_inputs(2, 16))
    assert len(tries) == 3 and g.stats["captured"] == 1 and g.stats["graphs"] == 1   # the third capture fitted
    g(*_inputs(2, 16))
    assert g.stats["replays"] == 1

    always_short = GraphedCalls(_fn([]), graph_factory=lambda fn, x, pool: (_ for _ in ()).throw(
        torch.OutOfMemoryError("CUDA out of memory")))
    for _ in range(12):
        always_short(*_inputs(2, 16))
    assert always_short.stats["capture_out_of_memory"] == 2 and always_short.stats["refusals"] == 1
    assert "OutOfMemoryError" in always_short.stats["refused"]["2x16"]


def test_a_capture_whose_replay_disagrees_is_refused():
    g = GraphedCalls(_fn([]), graph_factory=lambda fn, x, pool: FakeGraph(fn, x, pool, offset=0.5))
    for _ in range(3):
        out = g(*_inputs(1, 32))
    assert torch.equal(out[0], torch.full((1, 1), 64.0))         # the plain call's answer, not the replay's
    assert "differs from the plain call by 0.5" in g.stats["refused"]["1x32"]
    assert g.stats["graphs"] == 0


def test_a_graph_makes_room_for_a_new_shape_only_once_it_went_unused():
    g = GraphedCalls(_fn([]), max_graphs=2, stale_calls=4, graph_factory=FakeGraph)
    for tokens in (16, 32, 48):
        for _ in range(2):
            g(*_inputs(1, tokens))
    # 16 was replayed by no call since its capture, four calls ago: it made room for 48
    assert g.stats["graphs"] == 2 and g.stats["evicted"] == 1 and g.stats["captured"] == 3
    g(*_inputs(1, 32))       # still captured: a replay
    assert g.stats["replays"] == 1


def test_more_hot_shapes_than_graphs_never_capture_and_evict_in_turn():
    """A dynamic batcher's calls cycling through more shapes than the cap: the graphs first captured stay and
    are replayed, the other shapes run plain (counted `full`); no capture follows the cap's (each one stops the
    GPU). LRU alone captured and evicted on nearly every call of such a cycle."""
    made = []

    def factory(fn, inputs, pool):
        made.append(tuple(inputs[0].shape))
        return FakeGraph(fn, inputs, pool)

    g = GraphedCalls(_fn([]), max_graphs=4, stale_calls=64, graph_factory=factory)
    cycle = [(rows, 16) for rows in (1, 2, 3, 4, 5, 6)]
    for _ in range(20):
        for rows, tokens in cycle:
            g(*_inputs(rows, tokens))
    assert len(made) == 4 and "evicted" not in g.stats
    assert g.stats["replays"] == 4 * 18 and g.stats["full"] == 2 * 19   # captured on the second cycle
    for _ in range(70):                      # traffic moves to two new shapes: the old graphs go stale
        for rows in (7, 8):
            g(*_inputs(rows, 16))
    assert made[4:] == [(7, 16), (8, 16)] and g.stats["evicted"] == 2


def test_a_call_gets_a_stepped_shape_only_where_a_graph_may_replay_it():
    from laya_aot.padding import Ranges

    ranges = Ranges(min_rows=1, max_rows=64, min_tokens=16, max_tokens=1024, min_markers=2, max_markers=64)
    g = GraphedCalls(_fn([]), max_tokens=8192, graph_factory=FakeGraph)
    assert g.shape_for(33, 48, 3, ranges) == (40, 48, 3)
    assert g.shape_for(7, 800, 3, ranges) == (7, 896, 3)       # 50 units of 16 step to 56
    assert g.shape_for(9, 800, 3, ranges) is None              # 10 x 896 cells > 8192: a plain call, its own shape
    assert g.shape_for(64, 128, 4, ranges) == (64, 128, 4)


def test_inputs_move_to_the_functions_device_and_outputs_come_back_where_asked():
    """A runner that takes host inputs: plain calls move them to `device` first; every call's outputs, replayed or
    not, come back on `out_device`. "meta" stands for the other device, so a missed move cannot pass silently."""
    seen = []

    def fn(ids, att):
        seen.append(ids.device.type)
        return (torch.zeros(ids.shape[0], 1), torch.zeros(att.shape[0]))

    class Recorded(FakeGraph):
        def replay(self, inputs, out_device=None):
            assert all(x.device.type == "cpu" for x in inputs)  # host inputs go straight in
            self.replays += 1
            return [o.to(out_device) for o in self.fn(*inputs)]

    meta = torch.device("meta")
    g = GraphedCalls(fn, graph_factory=Recorded, device=meta)
    g._capture = lambda *args: None  # what a capture does is tested above
    out = g(*_inputs(1, 16), out_device=meta)
    assert seen == ["meta"] and all(o.device == meta for o in out)
    assert all(o.device.type == "cpu" for o in g(*_inputs(1, 16)))  # no out_device: where fn leaves them
    g._graphs[next(iter(g._seen))] = Recorded(fn, None, None)
    out = g(*_inputs(1, 16), out_device=meta)
    assert g.stats["replays"] == 1 and all(o.device == meta for o in out) and seen[-1] == "cpu"


def test_a_capture_is_checked_by_a_replay_that_takes_the_callers_inputs_and_gives_back_where_asked():
    """The replay a capture is checked with is the one later calls make: host inputs straight in, outputs on
    `out_device`; a replay that is right only when its outputs stay on the GPU (what the
    check once tried) must not pass."""
    seen = []

    class WrongOnCallersPath(FakeGraph):
        def replay(self, inputs, out_device=None):
            seen.append((inputs[0].device.type, out_device))
            out = [o.to(out_device or o.device) for o in self.fn(*inputs)]
            return [o + 1 for o in out] if out_device is not None else out  # wrong only on the callers' path

    g = GraphedCalls(lambda ids, att: (ids.float().sum(1, keepdim=True), att.float().mean(1)),
                     graph_factory=WrongOnCallersPath, device=torch.device("cpu"))
    cpu = torch.device("cpu")
    for _ in range(2):
        g(*_inputs(1, 16), out_device=cpu)
    assert seen == [("cpu", cpu)] and g.stats.get("refusals") == 1 and not g._graphs



def test_a_call_past_the_launch_bound_is_neither_stepped_nor_captured():
    """By default a graph replays only calls of at most 2,048 rows x tokens (where a replay stops saving launch
    time, `graphs.MAX_TOKENS`): a mixed stream's long calls run plain at their own shape, unpadded."""
    from laya_aot.padding import Ranges

    ranges = Ranges(min_rows=1, max_rows=64, min_tokens=16, max_tokens=1024, min_markers=2, max_markers=64)
    made = []
    g = GraphedCalls(_fn([]), graph_factory=lambda fn, x, pool: made.append(1) or FakeGraph(fn, x, pool))
    assert g.shape_for(3, 800, 3, ranges) is None              # 3 x 896 cells: plain, its own shape
    assert g.shape_for(5, 400, 3, ranges) is None
    assert g.shape_for(3, 100, 3, ranges) == (3, 112, 3)       # a short request's call: stepped, replayed
    for _ in range(4):
        g(*_inputs(2, 1040))
    assert not made and g.stats["plain_large"] == 4


def test_small_recurring_calls_are_still_captured_on_their_second_call_and_replayed():
    """A short stream's calls (a few stepped shapes of a few hundred cells) keep their graphs under the default
    policy: each shape captured on its second call, every later call replayed."""
    g = GraphedCalls(_fn([]), graph_factory=FakeGraph)
    for _ in range(20):
        for rows in (3, 24, 48):
            g(*_inputs(rows, 32))
    assert g.stats["captured"] == 3 and g.stats["replays"] == 3 * 18 and g.stats["plain_rare"] == 3


def test_a_shape_rarer_than_a_graphs_life_is_never_captured():
    """A shape whose calls come further apart than `stale_calls` calls would not be replayed before its graph could
    be dropped: it runs plain (`plain_rare`), however many times it comes in all."""
    made = []
    g = GraphedCalls(_fn([]), stale_calls=16, graph_factory=lambda fn, x, pool: made.append(1) or
                     FakeGraph(fn, x, pool))
    for i in range(5):
        g(*_inputs(1, 16))                                      # the rare shape
        for tokens in range(32, 32 + 16 * 20, 16):              # 20 calls of shapes seen once each in between
            g(*_inputs(i + 2, tokens))
    assert not made and g.stats["plain_rare"] == 5 * 21


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_captures_under_churn_take_at_most_their_share_of_the_time():
    """Mixed traffic: merged calls of ever new shapes, each recurring now and then, and captures that cost as much as
    50 plain calls. Every shape seen twice was captured before, each capture stopping the GPU (64 captures, 16 s of
    the 20 s); now captures take at most CAPTURE_SHARE of the time after a burst, and the rest run plain, counted."""
    from laya_aot.kinds import graphs

    clock = _Clock()

    def fn(ids, att):
        clock.now += 0.005                                     # a plain call: 5 ms
        return (ids.float().sum(1, keepdim=True), att.float().mean(1))

    def slow_capture(fn_, inputs, pool):
        clock.now += 0.25
        return FakeGraph(fn_, inputs, pool)

    g = GraphedCalls(fn, graph_factory=slow_capture, clock=clock)
    shapes = [(rows, 16 * t) for rows in range(1, 11) for t in range(1, 21)]   # 200 shapes, all small
    for i in range(4000):
        rows, tokens = shapes[(i * 7) % len(shapes)]
        g(*_inputs(rows, tokens))
    stats = g.stats
    assert stats["capture_s"] <= graphs.CAPTURE_BURST_S + graphs.CAPTURE_SHARE * clock.now + 0.25
    assert stats["plain_capture_budget"] > 0 and stats["captured"] < 20 and stats["replays"] > 0


def test_a_capture_leaves_the_allocators_caches_and_reports_its_own_error(monkeypatch):
    """`_Graph` captures without torch.cuda.graph's emptying of the allocator's caches (every plain call after a
    capture allocated its blocks again from the driver), in thread_local mode; a call that fails mid-capture ends the
    capture and raises its own error, so that running out of memory is still recognised (`_capture`)."""
    import contextlib

    from laya_aot.kinds import graphs

    events = []

    class Graph:
        def capture_begin(self, **kw):
            events.append(("begin", kw))

        def capture_end(self):
            events.append(("end",))
            raise RuntimeError("operation failed due to a previous error during capture")

    def emptied(*a):
        raise AssertionError("the allocator's cache was emptied")

    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "empty_cache", emptied)
    monkeypatch.setattr(torch._C, "_host_emptyCache", emptied, raising=False)
    monkeypatch.setattr(graphs, "_capture_stream", lambda device: None)

    def short(*inputs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    try:
        graphs._Graph(short, _inputs(1, 16), pool=None)
    except torch.OutOfMemoryError:
        pass
    else:
        raise AssertionError("the capture's own error was not raised")
    assert events == [("begin", {"capture_error_mode": "thread_local"}), ("end",)]

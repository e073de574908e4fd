"""The dynamic batcher's engine (laya_aot/runtime/batcher.py) on stand-in agents and routers: what it merges,
what it runs alone, how a failure stays with its request, the queue's bound, cancellation and closing. No model:
these run in a second. The answers of a real bundle in batches are tests/runtime/test_batch_answers.py's."""
from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError
from typing import Any, Dict, List, Optional

import pytest

from laya_aot.runtime.batcher import AgentTarget, Batcher, BatcherClosed, Limits, Overloaded, RouterTarget

Q = {"team": {"type": "choice", "instructions": "Which team?", "criteria": {"a": "x", "b": "y"}}}
Q2 = {"urgent": {"type": "noul", "instructions": "Urgent?"}}


class Agent:
    """Answers each state with its text; records every call; can be held inside a call until released."""

    def __init__(self) -> None:
        self.calls: List[tuple] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()
        self.lock = threading.Lock()

    def _answer(self, state: Any, questions: Dict[str, Any], kw: Dict[str, Any]) -> Dict[str, Any]:
        if state == "crash":
            raise RuntimeError("inference crashed on this state")
        if "bad" in questions:
            raise ValueError("question 'bad': unknown type")
        return {"state": state, "questions": sorted(questions), "kw": dict(kw)}

    def system_one(self, state, questions, **kw):
        with self.lock:
            self.calls.append(("system_one", [state], kw))
        self.entered.set()
        assert self.hold.wait(10)
        return self._answer(state, questions, kw)

    def predict_batch(self, states, questions, **kw):
        with self.lock:
            self.calls.append(("predict_batch", list(states), kw))
        self.entered.set()
        assert self.hold.wait(10)
        return [self._answer(s, questions, kw) for s in states]


def _held(agent: Agent, limits: Optional[Limits] = None) -> Batcher:
    """A batcher whose first call is in flight and held: what is submitted next waits in the queue."""
    agent.hold.clear()
    b = Batcher(agent, limits)
    b.submit("first", Q)
    assert agent.entered.wait(5)
    return b


def test_concurrent_requests_become_one_call_and_each_gets_its_own_answer():
    agent = Agent()
    b = _held(agent)
    futures = [b.submit("s%d" % i, Q) for i in range(10)]
    agent.hold.set()
    assert [f.result(5)["state"] for f in futures] == ["s%d" % i for i in range(10)]
    b.close()
    assert agent.calls[0] == ("system_one", ["first"], {})   # alone: laya's own call for one request
    assert agent.calls[1] == ("predict_batch", ["s%d" % i for i in range(10)], {})
    snap = b.stats.snapshot()
    assert snap["calls"]["merged"] == 1 and snap["calls"]["alone"] == 1
    assert snap["batch_requests"]["buckets"]["16"] == 1 and snap["batch_rows"]["count"] == 2
    assert snap["queue_wait_ms"]["count"] == 11 and snap["latency_ms"]["count"] == 11


def test_requests_merge_only_with_the_same_questions_and_controls():
    agent = Agent()
    b = _held(agent)
    futures = [b.submit("a", Q), b.submit("b", Q2), b.submit("c", Q, max_len=64), b.submit("d", Q),
               b.submit("e", Q, hooks=[print]), b.submit("f", Q, max_len=64)]
    agent.hold.set()
    answers = [f.result(5) for f in futures]
    b.close()
    assert [a["state"] for a in answers] == list("abcdef")
    assert answers[2]["kw"] == {"max_len": 64} and answers[4]["kw"] == {"hooks": [print]}
    calls = agent.calls[1:]
    assert ("predict_batch", ["a", "d"], {}) in calls and ("predict_batch", ["c", "f"], {"max_len": 64}) in calls
    assert ("system_one", ["b"], {}) in calls          # alone in its group: laya's call for one request
    assert ("system_one", ["e"], {"hooks": [print]}) in calls   # hooks cannot share a call: it runs alone
    assert len(calls) == 4


def test_requests_whose_questions_or_controls_laya_reads_apart_never_share_a_call():
    """Equal as JSON is not equal as laya reads it: criteria keyed `True` render "True", keyed "true" render
    "true"; `1` and `"1"` likewise; `min_confidence=True` and `1`, `head_max_len=128.0` and `128` compare equal but
    laya takes one and refuses the other. Such requests must not be answered with their neighbour's questions."""
    def q(criteria: Any) -> Dict[str, Any]:
        return {"r": {"type": "choice", "instructions": "Refund asked?", "criteria": criteria}}

    agent = Agent()
    b = _held(agent)
    futures = [b.submit("a", q({True: "x", False: "y"})), b.submit("b", q({"true": "x", "false": "y"})),
               b.submit("c", q({1: "x", 2: "y"})), b.submit("d", q({"1": "x", "2": "y"})),
               b.submit("e", q(("x", "y"))), b.submit("f", q(["x", "y"])),
               b.submit("g", Q, min_confidence=True), b.submit("h", Q, min_confidence=1),
               b.submit("i", Q, head_max_len=128.0), b.submit("j", Q, head_max_len=128),
               b.submit("k", q({"true": "x", "false": "y"})), b.submit("l", q(["x", "y"]))]
    agent.hold.set()
    assert [f.result(5)["state"] for f in futures] == list("abcdefghijkl")
    b.close()
    merged = [states for kind, states, _ in agent.calls[1:] if kind == "predict_batch"]
    assert sorted(merged) == [["b", "k"], ["f", "l"]], agent.calls    # only the truly equal ones
    kw = {tuple(states): call_kw for _, states, call_kw in agent.calls[1:]}
    assert kw[("g",)] == {"min_confidence": True} and kw[("h",)] == {"min_confidence": 1}
    assert type(kw[("i",)]["head_max_len"]) is float and type(kw[("j",)]["head_max_len"]) is int


def test_a_request_that_fails_fails_alone_and_its_neighbours_are_answered():
    agent = Agent()
    b = _held(agent)
    states = ["s0", "s1", "crash", "s3", "s4", "s5", "s6"]
    futures = [b.submit(s, Q) for s in states]
    agent.hold.set()
    for s, f in zip(states, futures):
        if s == "crash":
            with pytest.raises(RuntimeError, match="inference crashed"):
                f.result(5)
        else:
            assert f.result(5)["state"] == s
    b.close()
    assert ("system_one", ["crash"], {}) in agent.calls   # its own error came from its own call, alone
    assert b.stats.snapshot()["calls"]["split_after_error"] >= 1
    assert {"model": "auto", "outcome": "error", "count": 1} in b.stats.snapshot()["requests"]


def test_the_limits_bound_each_call_and_later_requests_keep_their_order():
    agent = Agent()
    b = _held(agent, Limits(max_rows=3))
    futures = [b.submit("s%d" % i, Q) for i in range(7)]
    agent.hold.set()
    assert [f.result(5)["state"] for f in futures] == ["s%d" % i for i in range(7)]
    b.close()
    assert [c[1] for c in agent.calls[1:]] == [["s0", "s1", "s2"], ["s3", "s4", "s5"], ["s6"]]


def test_the_token_estimate_bounds_a_call():
    agent = Agent()
    b = _held(agent, Limits(max_tokens=100))
    long_state = "word " * 200   # ~250 estimated tokens alone: over the bound, so it runs alone
    futures = [b.submit(long_state, Q), b.submit("x", Q), b.submit("y", Q)]
    agent.hold.set()
    [f.result(5) for f in futures]
    b.close()
    assert [c[1] for c in agent.calls[1:]] == [[long_state], ["x", "y"]]


def test_a_merged_call_splits_by_row_length_so_short_rows_are_not_padded_to_long_ones():
    agent = Agent()
    b = _held(agent)
    short, long_ = ["s%d" % i for i in range(3)], ["word " * (300 + i) for i in range(2)]   # ~48 / ~420 tokens a row
    futures = [b.submit(x, Q) for x in (short[0], long_[0], short[1], long_[1], short[2])]
    agent.hold.set()
    assert [f.result(5)["state"] for f in futures] == [short[0], long_[0], short[1], long_[1], short[2]]
    b.close()
    assert [c[1] for c in agent.calls[1:]] == [short, long_]   # two calls, shortest first
    one = Agent()
    b = _held(one, Limits(length_buckets=False))
    futures = [b.submit(x, Q) for x in (short[0], long_[0])]
    one.hold.set()
    [f.result(5) for f in futures]
    b.close()
    assert [c[1] for c in one.calls[1:]] == [[short[0], long_[0]]]


def test_each_call_is_made_for_the_oldest_request_with_those_of_its_length_group():
    agent = Agent()
    b = _held(agent)
    long_, short = ["word " * (300 + i) for i in range(2)], ["s%d" % i for i in range(2)]
    futures = [b.submit(x, Q) for x in (long_[0], short[0], long_[1], short[1])]
    agent.hold.set()
    [f.result(5) for f in futures]
    b.close()
    assert [c[1] for c in agent.calls[1:]] == [long_, short]   # the oldest (long) first, then the short ones


def test_no_call_pads_a_row_past_twice_its_length_and_none_passes_an_older_request_by():
    """Random lengths (20-4,000 characters) and question counts, queued behind a held call: every call's rows are
    estimated within 2x of each other (rows under SHORT_ROW tokens counted as SHORT_ROW), every call holds the
    oldest request not yet answered, and the limits hold."""
    import random

    from laya_aot.runtime.batcher import SHORT_ROW, estimate_tokens

    rng = random.Random(3)
    agent = Agent()
    limits = Limits(max_rows=12, max_tokens=4000)
    b = _held(agent, limits)
    sets = [Q, {**Q, **Q2}]
    reqs = [("%d " % i + "x" * rng.randint(20, 4000), rng.choice(sets)) for i in range(300)]
    futures = [b.submit(state, qs) for state, qs in reqs]
    agent.hold.set()
    [f.result(10) for f in futures]
    b.close()
    index = {state: i for i, (state, _) in enumerate(reqs)}
    served = set()
    for _, states, _ in agent.calls[1:]:
        ids = [index[s] for s in states]
        assert min(ids) == min(set(range(len(reqs))) - served)        # the oldest left is in this call
        served |= set(ids)
        rows = [max(SHORT_ROW, estimate_tokens(reqs[i][0], reqs[i][1], None) // len(reqs[i][1])) for i in ids]
        assert max(rows) <= 2 * min(rows)
        assert sum(len(reqs[i][1]) for i in ids) <= limits.max_rows or len(ids) == 1
    assert served == set(range(len(reqs))) and len(agent.calls) > 30


def test_length_groups_start_at_the_shortest_and_hold_up_to_twice_it():
    from laya_aot.runtime.batcher import length_groups

    assert length_groups([300, 128, 250, 257, 600, 129, 601]) == [1, 0, 0, 1, 2, 0, 2]
    assert length_groups([]) == [] and length_groups([500]) == [0]


def test_a_full_queue_refuses_at_once():
    agent = Agent()
    b = _held(agent, Limits(max_queue=2))
    b.submit("a", Q)
    b.submit("b", Q)
    t = time.perf_counter()
    with pytest.raises(Overloaded, match="queue is full"):
        b.submit("c", Q)
    assert time.perf_counter() - t < 1
    assert b.full() and b.stats.snapshot()["refused"]["overloaded"] == 1
    agent.hold.set()
    b.close()


def test_a_cancelled_request_is_dropped_and_a_running_one_cannot_be_cancelled():
    agent = Agent()
    b = _held(agent)
    gone, kept = b.submit("gone", Q), b.submit("kept", Q)
    assert gone.cancel()
    agent.hold.set()
    assert kept.result(5)["state"] == "kept"
    with pytest.raises(CancelledError):
        gone.result(0)
    agent.hold.clear()
    agent.entered.clear()
    running = b.submit("running", Q)
    assert agent.entered.wait(5)
    assert not running.cancel()   # in its call: it is answered
    agent.hold.set()
    assert running.result(5)["state"] == "running"
    b.close()
    assert all("gone" not in c[1] for c in agent.calls)
    assert b.stats.snapshot()["refused"]["cancelled"] == 1


def test_a_job_runs_between_calls_never_beside_one():
    agent = Agent()
    b = _held(agent)
    seen = []
    job = b.submit_job(lambda: seen.append(len(agent.calls)) or "unloaded")
    after = b.submit("after", Q)
    time.sleep(0.2)
    assert seen == []   # the held call is still running
    agent.hold.set()
    assert job.result(5) == "unloaded" and seen == [1]
    assert after.result(5)["state"] == "after"
    b.close()


def test_close_answers_what_was_accepted_then_refuses():
    agent = Agent()
    b = _held(agent)
    futures = [b.submit("s%d" % i, Q) for i in range(5)]
    closer = threading.Thread(target=b.close)
    closer.start()
    agent.hold.set()
    closer.join(10)
    assert not closer.is_alive()
    assert [f.result(0)["state"] for f in futures] == ["s%d" % i for i in range(5)]
    with pytest.raises(BatcherClosed):
        b.submit("late", Q)


def test_submissions_from_many_threads_are_each_answered():
    agent = Agent()
    b = Batcher(agent, Limits(max_rows=16))
    out: Dict[str, Any] = {}

    def caller(t: int) -> None:
        for i in range(40):
            state = "t%d-%d" % (t, i)
            out[state] = b.submit(state, Q).result(10)["state"]

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    b.close()
    assert len(out) == 640 and all(k == v for k, v in out.items())
    assert b.stats.snapshot()["calls"]["merged"] >= 1


def test_the_longest_wait_gathers_neighbours_that_arrive_after_the_first():
    agent = Agent()
    b = Batcher(agent, Limits(max_wait_ms=300))
    first = b.submit("a", Q)
    time.sleep(0.05)
    second = b.submit("b", Q)
    assert first.result(5)["state"] == "a" and second.result(5)["state"] == "b"
    b.close()
    assert agent.calls == [("predict_batch", ["a", "b"], {})]


@pytest.mark.parametrize("bad, says", [
    (dict(max_rows=0), "max_rows=0: a positive integer"), (dict(max_queue=1.5), "max_queue=1.5"),
    (dict(max_wait_ms=-1), "max_wait_ms=-1"), (dict(max_wait_ms=float("inf")), "max_wait_ms=inf"),
    (dict(max_wait_ms=1e13), "max_wait_ms=10000000000000.0: a number of milliseconds from 0 to 60000"),
    (dict(max_wait_ms=float("nan")), "max_wait_ms=nan"),
    (dict(length_buckets=1), "length_buckets=1: True or False"),
])
def test_bad_limits_are_one_clear_error(bad, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        Limits(**bad)


class Router:
    """A stand-in laya Router: predict and predict_batch answer with the request's fields."""

    def __init__(self) -> None:
        self.calls: List[tuple] = []

    def route(self, *a, **k):  # what makes it a Router to target_for
        raise AssertionError

    def predict(self, state, questions, **kw):
        self.calls.append(("predict", state, kw))
        return {"state": state, "kw": kw}

    def predict_batch(self, requests, **kw):
        self.calls.append(("predict_batch", [r["state"] for r in requests], kw))
        if any(r["state"] == "crash" for r in requests):
            raise RuntimeError("crash")
        return [{"state": r["state"], "kw": {k: v for k, v in r.items() if k not in ("state", "questions")}}
                for r in requests]


def test_a_router_target_merges_singles_and_batches_by_call_controls():
    router = Router()
    target = RouterTarget(router)
    works = [target.work("a", Q, {"model": "demo"}), target.work_many([{"state": "b", "questions": Q},
                                                                        {"state": "c", "questions": Q2}], {}),
             target.work("d", Q, {"lang": "de"})]
    assert len({w.key for w in works}) == 1 and works[1].rows == 2
    out = target.run(works)
    assert out[0] == {"state": "a", "kw": {"model": "demo"}}
    assert [r["state"] for r in out[1]] == ["b", "c"] and out[2]["kw"] == {"lang": "de"}
    assert router.calls == [("predict_batch", ["a", "b", "c", "d"], {})]
    # call-level controls split calls; one predict_batch does not take per-request min_confidence
    assert target.work("a", Q, {"min_confidence": 0.5}).key != works[0].key
    assert target.work_many([{"state": "a", "questions": Q}], {"batch_size": 2}).key != works[0].key
    assert target.work("a", Q, {"hooks": []}).key is None
    assert target.work_many([{"state": "a", "questions": Q, "diagnostics": {}}], {}).key is None


def test_a_router_batcher_answers_a_failing_request_alone_with_predict():
    router = Router()
    b = Batcher(router)
    b.submit_job(lambda: time.sleep(0.2))   # holds the worker so the next requests queue together
    futures = [b.submit(s, Q) for s in ("a", "crash", "c")]
    assert [f.result(5)["state"] for f in futures] == ["a", "crash", "c"]   # laya's predict, alone, answers it
    b.close()
    assert ("predict", "crash", {}) in router.calls
    assert isinstance(b.target, RouterTarget) and not isinstance(b.target, AgentTarget)


def test_a_call_that_raises_past_its_requests_fails_them_and_the_worker_goes_on():
    agent = Agent()

    def stop(*a, **k):
        raise KeyboardInterrupt  # not an Exception: not split, not retried
    agent.system_one = stop
    b = Batcher(agent)
    with pytest.raises(KeyboardInterrupt):
        b.submit("a", Q).result(5)
    agent.system_one = Agent().system_one
    assert b.submit("b", Q).result(5)["state"] == "b"
    b.close()


class _Gate:
    """An agent whose calls each wait at a barrier of `n`: the calls only finish if `n` of them run at once."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=5)
        self.running = 0
        self.most = 0
        self.lock = threading.Lock()
        self.jobs_beside: List[int] = []

    def _enter(self) -> None:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)

    def _leave(self) -> None:
        with self.lock:
            self.running -= 1

    def system_one(self, state, questions, **kw):
        self._enter()
        try:
            self.barrier.wait()
            return {"state": state}
        finally:
            self._leave()

    def predict_batch(self, states, questions, **kw):
        self._enter()
        try:
            self.barrier.wait()
            return [{"state": s} for s in states]
        finally:
            self._leave()


def test_lanes_run_calls_at_once_each_answered_and_a_job_runs_alone():
    """Over an engine a worker's calls are only sent from it: with lanes, the calls queued behind a running one go
    at once (the engine merges them), each still answered with its own result; a job still runs beside no call."""
    agent = _Gate(3)
    b = Batcher(agent, lanes=3)
    questions = [Q, Q2, {"other": {"type": "noul", "instructions": "Other?"}}]  # none may share a call
    first = [b.submit("s%d" % i, q) for i, q in enumerate(questions)]  # three calls at once, or the barrier breaks
    assert [f.result(10)["state"] for f in first] == ["s0", "s1", "s2"] and agent.most == 3
    agent.barrier = threading.Barrier(1)
    seen: List[int] = []
    calls = [b.submit("t%d" % i, Q) for i in range(20)]
    job = b.submit_job(lambda: seen.append(agent.running) or "done")
    later = [b.submit("u%d" % i, Q) for i in range(20)]
    assert job.result(10) == "done" and seen == [0]
    assert [f.result(10)["state"] for f in calls + later] == ["t%d" % i for i in range(20)] + [
        "u%d" % i for i in range(20)]
    b.close()
    assert not any(t.is_alive() for t in b._threads)


def test_one_lane_runs_one_call_at_a_time():
    agent = _Gate(1)
    b = Batcher(agent)
    assert [f.result(10)["state"] for f in [b.submit("s%d" % i, Q) for i in range(30)]] == [
        "s%d" % i for i in range(30)]
    b.close()
    assert agent.most == 1
    with pytest.raises(ValueError, match="lanes=0"):
        Batcher(agent, lanes=0)


def test_limits_given_as_a_dict_are_refused_at_construction_naming_the_fix():
    """A dict of limits was accepted and only the first submit failed (AttributeError: no max_queue)."""
    with pytest.raises(TypeError, match=r"limits=\{'max_rows': 4\} is not a Limits .*laya_aot\.Limits\(max_rows=4\)"):
        Batcher(Agent(), {"max_rows": 4})
    with pytest.raises(TypeError, match="is not a Limits"):
        Batcher(Agent(), 4)
    b = Batcher(Agent(), Limits(max_rows=4))
    assert b.limits.max_rows == 4 and Batcher(Agent()).limits == Limits()
    b.close()


def test_a_batcher_dropped_without_close_is_collected_and_its_worker_exits_after_answering():
    """The worker held the Batcher: one never closed kept its thread, and the agent, for the process's life. Its
    workers now hold only what they run, so the dropped batcher is collected and they finish what was accepted, as
    close() would have, then exit."""
    import gc
    import weakref

    agent = _Gate(1)
    b = Batcher(agent, name="dropped-batcher", lanes=2)
    assert b.submit("a", Q).result(5)["state"] == "a"
    agent.barrier = threading.Barrier(2, timeout=5)  # the next call waits for the test's thread
    pending = b.submit("b", Q)
    threads, ref = list(b._threads), weakref.ref(b)
    del b
    gc.collect()
    assert ref() is None
    agent.barrier.wait()
    assert pending.result(5)["state"] == "b"
    for thread in threads:
        thread.join(5)
    assert not any(t.is_alive() for t in threads)
    assert not [t for t in threading.enumerate() if t.name.startswith("dropped-batcher")]

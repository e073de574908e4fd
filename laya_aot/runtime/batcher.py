"""A dynamic batcher: concurrent requests to one laya Agent or Router merged into one `predict_batch` call.

laya answers a request at a time; an artifact call of 32 short rows costs about what one of a single row costs
on a GPU, and reads the weights once instead of 32 times on a CPU. `Batcher` takes requests from any number of
threads (`submit` returns a `concurrent.futures.Future`) and hands them to one worker thread (or `lanes` of
them), which merges those that may share a call (same call-level controls; laya's own `predict_batch` then groups
them by checkpoint, question set and budgets) into one `predict_batch` call and splits the results back.

Each call is made for the oldest waiting request, with the queued requests that may share its call and whose rows
are of its length group (`length_groups`: rows estimated within 2x of each other, rows under SHORT_ROW tokens
counted as SHORT_ROW): laya pads a call's rows to its longest, so no row is computed at more than twice its
estimated length (or 2 x SHORT_ROW), and no request waits behind requests that came after it but for those that
share a call ahead of it.

What a caller sees does not depend on its neighbours, except in the last bits of a probability (a row of a
wider, more padded batch): a request alone in the queue is laya's own call for one request (`system_one`,
`Router.predict`); a request whose settings cannot be merged runs alone; a merged call that raises is split
in halves and each half run again, down to each request alone with laya's own call, so a request that fails
(validation or inference) fails with laya's error and its neighbours are answered. A full queue refuses at once
(`Overloaded`), never an unbounded wait; a future cancelled before its call starts is dropped.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from bisect import bisect_left
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

from ..errors import LayaAotError

log = logging.getLogger(__name__)

# Defaults (docs/batching.md says why and what was measured): no wait, so that a request alone is never delayed
# (under load, requests queue while a call runs and make the next call without waiting); a call of at most one
# artifact piece of a GPU bundle (export.max_rows 64): a bigger call runs in pieces one after the other
# (runtime/backend.py) and every request in it waits for the last, where calls of one piece answer the first
# requests a piece earlier at the same throughput.
DEFAULT_MAX_ROWS = 64        # question rows (states x questions) in one merged call
DEFAULT_MAX_TOKENS = 65536   # estimated tokens in one merged call (rows x estimated row length)
DEFAULT_MAX_WAIT_MS = 0.0    # longest the first request of a call waits for neighbours (0: none)
MAX_WAIT_LIMIT_MS = 60_000.0  # at most a minute: past the clock's range the worker's timed wait fails outright
DEFAULT_MAX_QUEUE = 1024     # requests waiting; one more is refused with Overloaded
CHARS_PER_TOKEN = 4          # the row-length estimate: a state's characters per token, plus the question's head
HEAD_TOKENS = 48
SHORT_ROW = 128              # rows estimated shorter count as this long in length groups (their padding costs little)
GROUP_RATIO = 2.0            # the longest row of a length group against its shortest
GROUPED = 256                # queued requests of the oldest one's kind looked at for its length group

# histogram buckets: requests and rows per call, and milliseconds of waiting and of whole requests
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MS_BUCKETS = (0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)


class Overloaded(LayaAotError, RuntimeError):
    """The batcher's queue is full (`Limits.max_queue`): the request is refused at once."""


class BatcherClosed(LayaAotError, RuntimeError):
    """The batcher was closed: it takes no more requests."""


@dataclass(frozen=True)
class Limits:
    """How large a merged call may grow and how long the queue may be (see the module constants)."""

    max_rows: int = DEFAULT_MAX_ROWS
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_wait_ms: float = DEFAULT_MAX_WAIT_MS
    max_queue: int = DEFAULT_MAX_QUEUE
    length_buckets: bool = True  # a call's requests of one length group (`length_groups`): none padded past 2x

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_tokens", "max_queue"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError("%s=%r: a positive integer is needed" % (name, value))
        if not isinstance(self.length_buckets, bool):
            raise ValueError("length_buckets=%r: True or False is needed" % (self.length_buckets,))
        wait = self.max_wait_ms
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= MAX_WAIT_LIMIT_MS:
            raise ValueError("max_wait_ms=%r: a number of milliseconds from 0 to %g is needed"
                             % (wait, MAX_WAIT_LIMIT_MS))

    @classmethod
    def check(cls, limits: Any, argument: str = "limits") -> "Limits":
        """`limits` as a Batcher takes them (None: the defaults). Anything but a Limits (a dict of its fields) is
        refused here, naming the argument and the call that makes one: accepted, it failed only at the first
        `submit`, far from the mistake."""
        if limits is None:
            return cls()
        if isinstance(limits, cls):
            return limits
        if isinstance(limits, Mapping):
            fix = "laya_aot.Limits(%s)" % ", ".join("%s=%r" % (k, v) for k, v in limits.items())
        else:
            fix = "laya_aot.Limits(max_rows=..., max_tokens=..., max_wait_ms=..., max_queue=...)"
        raise TypeError("%s=%s is not a Limits (its type is %s); pass %s"
                        % (argument, repr(limits)[:80], type(limits).__name__, fix))


class Histogram:
    """Counts of observations at or below each bound (the last bucket: above every bound), their sum and count."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def as_dict(self) -> Dict[str, Any]:
        buckets = {("%g" % b): c for b, c in zip(self.bounds, self.counts)}
        buckets["+Inf"] = self.counts[-1]
        return {"count": self.n, "sum": round(self.total, 3), "buckets": buckets}


class Stats:
    """What the batcher did: requests by outcome, calls merged and alone, and histograms of requests and rows
    per call, of the wait in the queue and of whole requests (submit to answer). Thread-safe; `snapshot()` is
    `GET /v1/aot`'s `batching` entry and what `/metrics` exports."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Dict[Tuple[str, str], int] = {}  # (model asked for, outcome) -> count
        self.calls = {"merged": 0, "alone": 0, "split_after_error": 0, "jobs": 0}
        self.refused = {"overloaded": 0, "cancelled": 0}
        self.batch_requests = Histogram(SIZE_BUCKETS)
        self.batch_rows = Histogram(SIZE_BUCKETS)
        self.queue_wait_ms = Histogram(MS_BUCKETS)
        self.latency_ms = Histogram(MS_BUCKETS)

    def count(self, group: str, name: str, n: int = 1) -> None:
        with self._lock:
            table = getattr(self, group)
            table[name] = table.get(name, 0) + n

    def call(self, requests: int, rows: int, merged: bool) -> None:
        with self._lock:
            self.calls["merged" if merged else "alone"] += 1
            self.batch_requests.observe(requests)
            self.batch_rows.observe(rows)

    def waited(self, *ms: float) -> None:
        with self._lock:
            for v in ms:
                self.queue_wait_ms.observe(v)

    def answered(self, model: str, ok: bool, ms: float) -> None:
        self.answered_many([(model, ok, ms)])

    def answered_many(self, answers: Sequence[Tuple[str, bool, float]]) -> None:
        """Each (model, ok, ms) counted under one hold of the lock (a merged call's requests)."""
        with self._lock:
            requests, latency = self.requests, self.latency_ms
            for model, ok, ms in answers:
                key = (model, "ok" if ok else "error")
                requests[key] = requests.get(key, 0) + 1
                latency.observe(ms)

    def snapshot(self) -> Dict[str, Any]:
        with self._lock:
            return {"requests": [{"model": m, "outcome": o, "count": c} for (m, o), c in sorted(self.requests.items())],
                    "calls": dict(self.calls), "refused": dict(self.refused),
                    "batch_requests": self.batch_requests.as_dict(), "batch_rows": self.batch_rows.as_dict(),
                    "queue_wait_ms": self.queue_wait_ms.as_dict(), "latency_ms": self.latency_ms.as_dict()}


def merge_snapshots(snapshots: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """The sum of several `Stats.snapshot()`s (one server's worker processes): counts added, histograms added
    bucket by bucket (the same bounds in every process of one version)."""
    requests: Dict[Tuple[str, str], int] = {}
    out: Dict[str, Any] = {"calls": {}, "refused": {}}
    for snap in snapshots:
        for row in snap.get("requests", []):
            key = (row["model"], row["outcome"])
            requests[key] = requests.get(key, 0) + row["count"]
        for group in ("calls", "refused"):
            for name, n in snap.get(group, {}).items():
                out[group][name] = out[group].get(name, 0) + n
        for name in ("batch_requests", "batch_rows", "queue_wait_ms", "latency_ms"):
            hist = snap.get(name)
            if hist is None:
                continue
            into = out.setdefault(name, {"count": 0, "sum": 0.0, "buckets": {}})
            into["count"] += hist["count"]
            into["sum"] = round(into["sum"] + hist["sum"], 3)
            for bound, n in hist["buckets"].items():
                into["buckets"][bound] = into["buckets"].get(bound, 0) + n
    out["requests"] = [{"model": m, "outcome": o, "count": c} for (m, o), c in sorted(requests.items())]
    return out


@dataclass
class Work:
    """One submitted request as a target runs it: `key` says which others it may share a call with (None: it runs
    alone), `items` what the merged call takes of it, `alone()` laya's own call for it by itself. `many`: its
    answer is the list of its items' results (a batch request), else its one item's result."""

    key: Optional[Hashable]
    items: List[Any]
    alone: Callable[[], Any]
    rows: int
    tokens: int
    model: str = "auto"
    many: bool = False
    controls: Dict[str, Any] = field(default_factory=dict)  # the merged call's keyword arguments
    counted: bool = True  # its answer is a request in Stats.requests and latency_ms (False: one call of a request
    #                       its submitter counts once, whatever calls it takes: a tournament's rounds)

    @property
    def row_tokens(self) -> int:
        """Its rows' estimated length (at least SHORT_ROW: short rows share a call whatever their lengths)."""
        return max(SHORT_ROW, self.tokens // max(1, self.rows))


@dataclass
class _Entry:
    work: Optional[Work]
    future: Future
    submitted: float
    job: Optional[Callable[[], Any]] = None
    started: float = 0.0


def length_groups(lengths: Sequence[int]) -> List[int]:
    """Each length's group: the lengths sorted, a group started at the shortest not yet grouped and holding every
    length up to twice it. No length of a group is more than twice another's; groups adapt to the lengths present
    (fixed classes by powers of two split close lengths at their bounds and made more, emptier calls)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    group, start, out = -1, 0, [0] * len(lengths)
    for i in order:
        if group < 0 or lengths[i] > GROUP_RATIO * start:
            group, start = group + 1, lengths[i]
        out[i] = group
    return out


def state_chars(state: Any) -> int:
    """The length of the text laya tokenises for `state` (its JSON for a dict or list), for the token estimate."""
    if isinstance(state, str):
        return len(state)
    try:
        return len(json.dumps(state, ensure_ascii=False))
    except (TypeError, ValueError):
        return 0


def estimate_tokens(state: Any, questions: Mapping[str, Any], max_len: Optional[int]) -> int:
    """Tokens a state's rows will hold, estimated before tokenising: each question's row holds the state and the
    question's head, at most the context (`max_len`, laya's default 512 when unknown)."""
    row = min(int(max_len or 512), state_chars(state) // CHARS_PER_TOKEN + HEAD_TOKENS)
    return max(1, len(questions)) * row


_KEY_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)  # json.dumps' encoder, made once


_JSON_TYPES = (str, int, float, bool, type(None))


def _plain_json(value: Any) -> bool:
    """Whether `value` is made only of JSON's own types (str keys; exact types, no subclasses or tuples): then two
    values with equal JSON are equal as laya reads them. Otherwise JSON would make `{1: ...}` and `{"1": ...}`,
    `True` and `true`, or an enum and its value one key, which laya renders apart (`str(key)`)."""
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is dict:
            for k, x in v.items():
                if type(k) is not str:
                    return False
                stack.append(x)
        elif t is list:
            stack.extend(v)
        elif t not in _JSON_TYPES:
            return False
    return True


def questions_key(questions: Any) -> Optional[str]:
    """A key equal for equal question sets, order included as laya's grouping keys them (None: not plain JSON; such
    a request is answered alone)."""
    if not _plain_json(questions):
        return None
    try:
        return _KEY_JSON.encode(questions)
    except (TypeError, ValueError):  # NaN is JSON's: an infinite or circular value is not
        return None


def _key_part(value: Any) -> Optional[Hashable]:
    """A control as a key part: its type and JSON (`True` and `1`, `128.0` and `128` apart, as laya may treat
    them apart; None: not plain JSON)."""
    key = questions_key(value)
    return None if key is None else (type(value).__name__, key)


class AgentTarget:
    """Requests to one laya Agent (what `laya_aot.load` returns): merged by question set and controls into
    `agent.predict_batch`, a request alone answered by `agent.system_one`, as laya answers it."""

    MERGED = ("lang", "max_len", "head_max_len", "min_confidence")  # what predict_batch takes for every state
    _MERGED = frozenset(MERGED)

    def __init__(self, agent: Any):
        self.agent = agent

    def work(self, state: Any, questions: Dict[str, Any], controls: Dict[str, Any]) -> Work:
        def alone() -> Any:
            return self.agent.system_one(state, questions, **controls)

        key: Optional[Hashable] = None
        if isinstance(questions, dict) and state is not None and controls.keys() <= self._MERGED:
            qkey = questions_key(questions)
            parts = tuple((k, _key_part(controls[k])) for k in sorted(controls)) if controls else ()
            if qkey is not None and all(v is not None for _, v in parts):
                key = (qkey, parts)
        rows = len(questions) if isinstance(questions, dict) else 1
        tokens = estimate_tokens(state, questions, controls.get("max_len")) if isinstance(questions, dict) else 1
        return Work(key=key, items=[(state, questions)], alone=alone, rows=rows, tokens=max(1, tokens),
                    controls=controls)

    def run(self, works: Sequence[Work]) -> List[Any]:
        questions = works[0].items[0][1]
        out = self.agent.predict_batch([w.items[0][0] for w in works], questions, **works[0].controls)
        if len(out) != len(works):
            raise RuntimeError("predict_batch returned %d results for %d states" % (len(out), len(works)))
        return list(out)


class RouterTarget:
    """Requests to a laya Router (laya-aot serve's): merged into one `Router.predict_batch`, which routes each
    request and groups them by checkpoint, question set and budgets, as it does any batch; a request alone is
    answered by the call laya's server makes for it (`Router.predict`, or its own `predict_batch`)."""

    ITEM = ("model", "task", "lang", "lang_guess", "max_len", "head_max_len")  # per request in predict_batch
    CALL = ("min_confidence", "batch_size", "sort_by_length")  # per predict_batch call: equal in a merged call

    def __init__(self, router: Any):
        self.router = router

    @staticmethod
    def _call_key(controls: Mapping[str, Any]) -> Optional[Hashable]:
        parts = tuple((k, _key_part(controls[k])) for k in sorted(controls))
        return None if any(v is None for _, v in parts) else parts

    def work(self, state: Any, questions: Dict[str, Any], controls: Dict[str, Any]) -> Work:
        """`Router.predict(state, questions, **controls)`, mergeable when every control has a place in
        predict_batch (a request's routing and budget, or min_confidence for the call)."""
        def alone() -> Any:
            return self.router.predict(state, questions, **controls)

        item = {k: v for k, v in controls.items() if k in self.ITEM}
        call = {k: v for k, v in controls.items() if k == "min_confidence"}
        mergeable = (isinstance(questions, dict) and state is not None and hasattr(self.router, "predict_batch")
                     and set(controls) <= set(item) | set(call))
        key = self._call_key(call) if mergeable else None
        rows = len(questions) if isinstance(questions, dict) else 1
        tokens = estimate_tokens(state, questions, controls.get("max_len")) if isinstance(questions, dict) else 1
        return Work(key=key, items=[dict(state=state, questions=questions, **item)], alone=alone, rows=rows,
                    tokens=max(1, tokens), model=str(controls.get("model") or "auto"), controls=call)

    def work_many(self, requests: Sequence[Dict[str, Any]], controls: Dict[str, Any]) -> Work:
        """`Router.predict_batch(requests, **controls)`: mergeable with calls of the same call-level controls."""
        requests = list(requests) if isinstance(requests, (list, tuple)) else requests

        def alone() -> Any:
            return self.router.predict_batch(requests, **controls)

        ok = (isinstance(requests, list) and requests and set(controls) <= set(self.CALL)
              and all(isinstance(r, dict) and set(r) <= {"state", "questions", *self.ITEM} and "state" in r
                      and isinstance(r.get("questions"), dict) for r in requests))
        key = self._call_key(controls) if ok else None
        rows = sum(len(r["questions"]) for r in requests) if ok else 1
        tokens = sum(estimate_tokens(r["state"], r["questions"], r.get("max_len")) for r in requests) if ok else 1
        model = str((requests[0].get("model") if ok else None) or "auto")
        return Work(key=key, items=list(requests) if ok else [], alone=alone, rows=max(1, rows),
                    tokens=max(1, tokens), model=model, many=True, controls=dict(controls))

    def run(self, works: Sequence[Work]) -> List[Any]:
        flat = [item for w in works for item in w.items]
        out = self.router.predict_batch(flat, **works[0].controls)
        if len(out) != len(flat):
            raise RuntimeError("predict_batch returned %d results for %d requests" % (len(out), len(flat)))
        results, i = [], 0
        for w in works:
            n = len(w.items)
            results.append(list(out[i:i + n]) if w.many else out[i])
            i += n
        return results


def target_for(obj: Any) -> Any:
    """The target for a laya Agent or Router (anything with `predict_batch` and `system_one`/`predict`)."""
    if isinstance(obj, (AgentTarget, RouterTarget)):
        return obj
    from laya.router import Router

    if isinstance(obj, Router) or (hasattr(obj, "route") and hasattr(obj, "predict")):
        return RouterTarget(obj)
    if hasattr(obj, "system_one") and hasattr(obj, "predict_batch"):
        return AgentTarget(obj)
    raise TypeError("Batcher needs a laya Agent (laya_aot.load) or a laya Router, got %s" % type(obj).__name__)


@dataclass
class _Batch:
    entries: List[_Entry] = field(default_factory=list)
    rows: int = 0
    tokens: int = 0


class _Core:
    """A Batcher's queue, lock, target and worker threads: all its workers hold. They hold no reference to the
    Batcher itself, so a Batcher dropped without `close()` is collected, and its finalizer closes this: the workers
    answer what was accepted, as `close()` has them, then exit and release the target."""

    def __init__(self, target: Any, limits: Limits, wrap: Callable[[Callable[[], Any]], Any], stats: Stats):
        self.target = target
        self.limits = limits
        self.stats = stats
        self.wrap = wrap
        self.cv = threading.Condition()
        self.queue: Deque[_Entry] = deque()
        self.closed = False
        self.running = 0          # calls and jobs running now (at most the lanes)
        self.exclusive = False    # a job is running: no call beside it
        self.threads: List[threading.Thread] = []

    def start(self, name: str, lanes: int) -> None:
        self.threads = [threading.Thread(target=self.worker, name="%s-%d" % (name, i) if lanes > 1 else name,
                                         daemon=True) for i in range(lanes)]
        for thread in self.threads:
            thread.start()

    def put(self, entry: _Entry, count: bool = True) -> Future:
        with self.cv:
            if self.closed:
                raise BatcherClosed("the batcher is closed")
            if count and len(self.queue) >= self.limits.max_queue:
                self.stats.count("refused", "overloaded")
                raise Overloaded("the batcher's queue is full (%d requests waiting; max_queue=%d)"
                                 % (len(self.queue), self.limits.max_queue))
            self.queue.append(entry)
            self.cv.notify()
        return entry.future

    def close(self, wait: bool = True, cancel: bool = False) -> None:
        with self.cv:
            self.closed = True
            if cancel:
                while self.queue:
                    entry = self.queue.popleft()
                    if entry.future.cancel():
                        self.stats.count("refused", "cancelled")
            self.cv.notify_all()
        if wait and threading.current_thread() not in self.threads:
            for thread in self.threads:
                thread.join()

    # ------------------------------------------------------------------ the worker
    def take(self) -> Optional[_Batch]:
        """The next call's entries (under the lock): the oldest entry and, if it may share a call, the queued entries
        with its key (of the first GROUPED) in its length group (`length_groups`, unless `Limits.length_buckets` is
        off), oldest first, while the call stays within the limits; the others keep their places. None once closed
        and drained."""
        limits = self.limits
        while True:  # again after any wait: another lane may have taken the head meanwhile
            self.cv.wait_for(lambda: (self.queue and not self.exclusive) or (self.closed and not self.queue))
            if not self.queue:
                return None
            head = self.queue[0]
            if head.job is not None:  # a job runs with no call beside it: after those running, before any other
                if self.running:
                    self.cv.wait()
                    continue
                self.exclusive = True
                return _Batch([self.queue.popleft()])
            if head.work is None or head.work.key is None:
                return _Batch([self.queue.popleft()])
            key = head.work.key
            if limits.max_wait_ms <= 0 or self.closed:
                break
            rows = sum(e.work.rows for e in self.queue if e.job is None and e.work is not None and e.work.key == key)
            left = head.submitted + limits.max_wait_ms / 1000.0 - time.perf_counter()
            if rows >= limits.max_rows or left <= 0:  # neighbours waited for, up to the wait or a full call
                break
            self.cv.wait(left)
        kind = [e for e in self.queue if e.job is None and e.work is not None and e.work.key == key][:GROUPED]
        if limits.length_buckets and len(kind) > 1:
            groups = length_groups([e.work.row_tokens for e in kind])  # type: ignore[union-attr]
            kind = [e for e, g in zip(kind, groups) if g == groups[0]]  # kind[0] is the head
        batch = _Batch()
        for entry in kind:
            work = entry.work
            if batch.entries and (batch.rows + work.rows > limits.max_rows  # type: ignore[union-attr]
                                  or batch.tokens + work.tokens > limits.max_tokens):  # type: ignore[union-attr]
                break  # the call is full: later requests keep their places behind this one
            batch.entries.append(entry)
            batch.rows += work.rows  # type: ignore[union-attr]
            batch.tokens += work.tokens  # type: ignore[union-attr]
        taken = {id(e) for e in batch.entries}
        self.queue = deque(e for e in self.queue if id(e) not in taken)
        return batch

    def worker(self) -> None:
        while True:
            with self.cv:
                batch = self.take()
                if batch is None:
                    return
                self.running += 1
            try:
                self.run(batch)
            except BaseException as e:  # noqa: BLE001 - the worker must outlive anything a call raises
                log.exception("laya-aot batcher: a call failed outside its requests")
                for entry in batch.entries:  # none of its requests waits for ever
                    if not entry.future.done():
                        entry.future.set_exception(RuntimeError("the batcher's call failed: %r" % (e,)))
            finally:
                with self.cv:
                    self.running -= 1
                    self.exclusive = False
                    self.cv.notify_all()  # a job waiting for the calls to end, or lanes waiting for a job

    def run(self, batch: _Batch) -> None:
        now = time.perf_counter()
        live = []
        for entry in batch.entries:
            if entry.future.set_running_or_notify_cancel():
                entry.started = now
                live.append(entry)
            else:
                self.stats.count("refused", "cancelled")
        if not live:
            return
        if live[0].job is not None:
            self.stats.count("calls", "jobs")
            self.settle(live[0], live[0].job)
            return
        self.stats.waited(*[(now - entry.submitted) * 1000.0 for entry in live])
        self.answer(live)

    def answer(self, entries: List[_Entry]) -> None:
        """Run `entries` in one call (alone: laya's own call); after an error, each half again (see module)."""
        rows = sum(e.work.rows for e in entries)  # type: ignore[union-attr]
        if len(entries) == 1:
            entry = entries[0]
            self.stats.call(1, rows, merged=False)
            self.settle(entry, lambda: self.wrap(entry.work.alone))  # type: ignore[union-attr]
            return
        self.stats.call(len(entries), rows, merged=True)
        try:
            results = self.wrap(lambda: self.target.run([e.work for e in entries]))
        except Exception as e:  # noqa: BLE001 - one request's error must not fail its neighbours
            self.stats.count("calls", "split_after_error")
            log.info("laya-aot batcher: a merged call of %d requests raised %s: %s; running it again in halves",
                     len(entries), type(e).__name__, e)
            mid = len(entries) // 2
            self.answer(entries[:mid])
            self.answer(entries[mid:])
            return
        now = time.perf_counter()
        self.stats.answered_many([(e.work.model, True, (now - e.submitted) * 1000.0)  # type: ignore[union-attr]
                                  for e in entries if e.work.counted])  # type: ignore[union-attr]
        for entry, result in zip(entries, results):
            entry.future.set_result(result)

    def settle(self, entry: _Entry, call: Callable[[], Any]) -> None:
        try:
            result = call()
        except BaseException as e:  # noqa: BLE001 - handed to the caller, as the call's own error
            self.done(entry, error=e)
            if not isinstance(e, Exception):
                raise
        else:
            self.done(entry, result=result)

    def done(self, entry: _Entry, result: Any = None, error: Optional[BaseException] = None) -> None:
        if entry.work is not None and entry.work.counted:
            self.stats.answered(entry.work.model, error is None, (time.perf_counter() - entry.submitted) * 1000.0)
        if error is None:
            entry.future.set_result(result)
        else:
            entry.future.set_exception(error)


def _call(call: Callable[[], Any]) -> Any:
    return call()


class Batcher:
    """A thread-safe dynamic batcher over one laya Agent or Router (see the module docstring).

        batcher = Batcher(laya_aot.load(checkpoint, bundle=bundle))
        future = batcher.submit(state, questions)        # from any thread; future.result() is system_one's answer
        batcher.close()                                  # answers what was accepted, then stops

    `close()` (or `with Batcher(...) as batcher:`) is the way to end it: it returns once its worker has answered
    what was accepted. A batcher dropped without it is not leaked (its workers hold no reference to it): once
    collected, its workers answer what was accepted and exit, releasing the agent, but only when the garbage
    collector gets to it.

    `wrap(call)` runs each call on the worker (laya's server passes the function that marks its last request);
    `stats` may be shared between batchers (one server's, across restarts of its app). `lanes`: calls run at once
    by that many worker threads, for a target whose forward takes calls from several threads (a serving worker's
    thin agent over the engine, which merges them); an agent with its own artifact needs 1 (a CUDA graph's buffers
    are one call's). A job still runs beside no call."""

    def __init__(self, target: Any, limits: Optional[Limits] = None, *, name: str = "laya-aot-batcher",
                 wrap: Optional[Callable[[Callable[[], Any]], Any]] = None, stats: Optional[Stats] = None,
                 lanes: int = 1):
        if type(lanes) is not int or lanes < 1:
            raise ValueError("lanes=%r: a positive integer is needed" % (lanes,))
        self.limits = Limits.check(limits)
        self.target = target_for(target)
        self.stats = stats if stats is not None else Stats()
        self._core = _Core(self.target, self.limits, wrap or _call, self.stats)
        self._core.start(name, lanes)
        self._threads = self._core.threads
        # closes the core once this batcher is collected; the core never refers back to it
        weakref.finalize(self, self._core.close, False)

    # ------------------------------------------------------------------ submitting
    def submit(self, state: Any, questions: Dict[str, Any], **controls: Any) -> Future:
        """A future of the answer to one request, as `system_one` (an Agent) or `Router.predict` (a Router) gives
        it; `controls` are their keyword arguments. The state and questions must not change until it is done.
        Raises Overloaded when the queue is full, BatcherClosed after `close()`."""
        return self.submit_work(self.target.work(state, questions, dict(controls)))

    def submit_many(self, requests: Sequence[Dict[str, Any]], **controls: Any) -> Future:
        """A future of `Router.predict_batch(requests, **controls)`'s list of answers (a Router target only)."""
        if not isinstance(self.target, RouterTarget):
            raise TypeError("submit_many needs a Router target; submit each state to an Agent's batcher")
        return self.submit_work(self.target.work_many(requests, dict(controls)))

    def submit_work(self, work: Work) -> Future:
        return self._core.put(_Entry(work=work, future=Future(), submitted=time.perf_counter()))

    def submit_job(self, job: Callable[[], Any]) -> Future:
        """`job()` on the worker between calls, never beside one (laya's server's idle unload runs so)."""
        return self._core.put(_Entry(work=None, future=Future(), submitted=time.perf_counter(), job=job),
                              count=False)

    def queued(self) -> int:
        with self._core.cv:
            return len(self._core.queue)

    def full(self) -> bool:
        with self._core.cv:
            return len(self._core.queue) >= self.limits.max_queue

    def busy(self) -> bool:
        """Whether a call or job is running, or one is waiting to."""
        with self._core.cv:
            return self._core.running > 0 or bool(self._core.queue)

    def close(self, wait: bool = True, cancel: bool = False) -> None:
        """Take no more requests; answer those accepted (or, with `cancel`, cancel those not started). With `wait`,
        return once the workers have (unless called from one of them, as a done-callback may be)."""
        self._core.close(wait, cancel)

    def __enter__(self) -> "Batcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["AgentTarget", "Batcher", "BatcherClosed", "Histogram", "Limits", "Overloaded", "RouterTarget", "Stats",
           "Work", "estimate_tokens", "length_groups", "merge_snapshots", "target_for"]

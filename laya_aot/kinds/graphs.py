"""CUDA graphs for an artifact's small calls, where kernel launches, not the GPU, set the latency.

At 1 row x 128 tokens a 28-layer encoder is a few hundred short kernels: the GPU waits on the CPU launching
them. A CUDA graph replays the whole forward with one launch, so it saves at most a plain call's launch time,
and only while the GPU's work is shorter than that. A graph pays only where three things hold:

- the call is launch-bound: its stepped shape is at most `max_tokens` rows x tokens (MAX_TOKENS says why
  2,048). A larger call runs plain at its own shape: a replay would save nothing, and the stepped shape's
  padding would cost GPU time;
- its shape recurs: the backend pads a small call to its stepped shape (`shape_for`: `padding.Ranges.call_shape`,
  rows, tokens and markers each stepped) so that a service's calls take few shapes, and a shape is captured on
  its `capture_after`-th call within `stale_calls` calls (the first one warms it, so nothing loads lazily
  during capture). A shape rarer than that would not be replayed within a graph's life;
- captures do not eat the time they save: each one synchronizes the GPU, records the whole forward, instantiates
  the graph and checks one replay, and under mixed traffic (merged calls of varied lengths, questions and row
  counts) new shapes keep coming. Captures may take `capture_share` of the wall time since the first call (plus
  `capture_burst_s` ahead, for a service's first shapes), whatever one costs on this GPU and model; a call
  that finds the budget spent runs plain and its shape is captured on a later call.

At most `max_graphs` are kept, and one is dropped for a new shape only when no call has replayed it for
`stale_calls` calls: a working set larger than the cap leaves the rest to plain calls instead of capturing
and evicting in turn. Each capture is checked against the plain call it replaces; a capture that fails or
disagrees turns graphs off for that shape, with the reason in `stats`, which also counts the plain calls by
reason (`plain_large`, `plain_rare`, `plain_capture_budget`, `full`, `plain_refused`) and the seconds spent
capturing (`capture_s`).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import out_of_memory

log = logging.getLogger(__name__)

# rows x tokens of the largest call replayed: where a replay stops saving time. On an H100, large-1024 (28
# layers, laya's largest encoder) replayed at 8 x 256 in 4.51 ms, about what a plain call's launches take alone
# (5.26 ms against 1.59 ms replayed at 1 x 128 on an H200): past 2,048 cells its GPU work hides the launches. A
# smaller encoder is launch-bound a little further (its cells cost less), where it loses at most the part of
# its launches that its GPU work does not hide
MAX_TOKENS = 2048
# graphs kept: the stepped shapes a service's calls take (padding.step_up: 20 row counts up to 64, for each of
# its token steps) fit; every graph shares one memory pool (the largest call's activations), so each one more
# costs its static inputs and outputs and the graph's own host memory
MAX_GRAPHS = 64
STALE_CALLS = 1024  # calls without a replay after which a graph may make room for a new shape
CAPTURE_AFTER = 2  # calls of a shape within STALE_CALLS calls before it is captured (the first one warms it)
# the wall time captures may take: a graph saves at most a plain call's launches (a few ms), so captures are held
# to a share that bounds what churn costs (5% of the throughput) whatever a capture costs, and a burst that lets
# a service's first shapes (a few tens, at tens of ms each) be captured at once
CAPTURE_SHARE = 0.05
CAPTURE_BURST_S = 2.0
CAPTURE_TRIES_SHORT_OF_MEMORY = 3  # captures of one shape that may run out of memory before it runs plain for good
# replay vs plain call on the same inputs: the same kernels on the same data, so this is generous
ATOL = RTOL = 1e-3

_CAPTURE_LOCK = threading.Lock()
_STREAMS: Dict[torch.device, Any] = {}


def _capture_stream(device: torch.device) -> Any:
    """One side stream per GPU to capture on (made under _CAPTURE_LOCK)."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device=device)
    return _STREAMS[device]

Key = Tuple[Tuple[Tuple[int, ...], torch.dtype], ...]
Fn = Callable[..., Sequence[torch.Tensor]]


class _Graph:
    """One captured call: static input buffers, the graph, and its static outputs.

    Capture and replay run with the inputs' GPU as the current device: torch.cuda.graph captures on a side
    stream of the current device, so an agent on cuda:1 in a process whose current device is cuda:0
    would otherwise capture on the wrong GPU (and every GPU but the first would lose its graphs).

    Inputs and outputs are copied tensor by tensor from and to pageable memory: packed into one pinned buffer
    with one asynchronous copy each way they were no faster (0.96-1.02x on an H200 and 0.99-1.00x on an H100,
    `benchmarks/results/calls.md`)."""

    def __init__(self, fn: Fn, inputs: Sequence[torch.Tensor], pool: Any):
        self.device = inputs[0].device
        # one capture at a time in the process, each on a side stream of its own GPU: torch.cuda.graph's default
        # capture stream is made once per process, on the GPU current at the first capture, so a second GPU's
        # capture failed with "invalid resource handle" (two-GPU run)
        with _CAPTURE_LOCK, torch.cuda.device(self.device):
            self.inputs = [x.clone() for x in inputs]
            self.graph = torch.cuda.CUDAGraph()
            # captured as torch.cuda.graph captures, less its emptying of the allocator's caches (device and
            # pinned host) on entry: that freed every block the plain calls between captures had cached, which
            # each then allocated again from the driver. A capture that runs out of memory empties the cache
            # before its shape is tried again (GraphedCalls._capture)
            torch.cuda.synchronize(self.device)
            with torch.cuda.stream(_capture_stream(self.device)):
                # thread_local: another thread of the service using CUDA meanwhile does not break the capture
                self.graph.capture_begin(**({} if pool is None else {"pool": pool}),
                                         capture_error_mode="thread_local")
                try:
                    self.outputs = list(fn(*self.inputs))
                except BaseException:
                    try:  # the capture's own error, not the invalidated capture's, is the one to report
                        self.graph.capture_end()
                    except Exception:  # noqa: BLE001
                        pass
                    raise
                self.graph.capture_end()

    def replay(self, inputs: Sequence[torch.Tensor], out_device: Optional[torch.device] = None) -> List[torch.Tensor]:
        """Copies `inputs` (from any device: host tensors go straight into the static buffers) and replays; the
        outputs are copies on `out_device` (None: this GPU), since the next replay overwrites the static ones."""
        with torch.cuda.device(self.device):
            for dst, src in zip(self.inputs, inputs):
                dst.copy_(src)
            self.graph.replay()
            if out_device is None or torch.device(out_device) == self.device:
                return [o.clone() for o in self.outputs]
            return [o.to(out_device) for o in self.outputs]

    def pool(self) -> Any:
        return self.graph.pool()


def _key(inputs: Sequence[torch.Tensor]) -> Key:
    return tuple((tuple(x.shape), x.dtype) for x in inputs)


def _disagreement(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> Optional[str]:
    for x, y in zip(a, b):
        if x.shape != y.shape or not torch.allclose(x.float(), y.float(), rtol=RTOL, atol=ATOL, equal_nan=True):
            diff = (x.float() - y.float()).abs().max() if x.shape == y.shape else float("nan")
            return "its replay differs from the plain call by %.3g" % float(diff)
    return None


class GraphedCalls:
    """Calls `fn(*tensors)`; small shapes that recur are captured and replayed as CUDA graphs (module docstring).

    Not thread-safe by itself: the runner that owns it serialises calls (as AOTIRunner does).
    `graph_factory` exists for tests on machines without CUDA.
    """

    def __init__(self, fn: Fn, max_tokens: int = MAX_TOKENS, max_graphs: int = MAX_GRAPHS,
                 graph_factory: Callable[[Fn, Sequence[torch.Tensor], Any], Any] = _Graph,
                 device: Optional[torch.device] = None, stale_calls: int = STALE_CALLS,
                 capture_after: int = CAPTURE_AFTER, capture_share: float = CAPTURE_SHARE,
                 capture_burst_s: float = CAPTURE_BURST_S, clock: Callable[[], float] = time.perf_counter):
        self._fn = fn
        self.device = device  # where `fn` takes its inputs (None: they come there already)
        self.max_tokens = max_tokens
        self.max_graphs = max_graphs
        self.stale_calls = stale_calls
        self.capture_after = max(2, int(capture_after))  # the first call warms a shape: never captured
        self._factory = graph_factory
        self._graphs: "OrderedDict[Key, Any]" = OrderedDict()
        self._used: Dict[Key, int] = {}  # the call count at each graph's last replay (or capture)
        self._calls = 0
        # per shape not captured, the call counts of its last `capture_after` calls
        self._seen: Dict[Key, Deque[int]] = {}
        self._capture_s = 0.0  # seconds spent capturing and checking captures
        self.capture_share = capture_share
        self.capture_burst_s = capture_burst_s
        self._clock = clock
        self._budget = capture_burst_s  # capture seconds available now (`_affordable`)
        self._budget_at: Optional[float] = None
        self._refused: Dict[Key, str] = {}
        self._short: Counter = Counter()  # captures per shape that ran out of memory
        self._pool: Any = None  # one memory pool for all graphs: calls are serialised, outputs cloned
        self._counts: Counter = Counter()

    def eligible(self, inputs: Sequence[torch.Tensor]) -> bool:
        ids = inputs[0]
        return ids.dim() == 2 and ids.shape[0] * ids.shape[1] <= self.max_tokens

    def shape_for(self, rows: int, tokens: int, markers: int, ranges: Any) -> Optional[Tuple[int, int, int]]:
        """The shape (rows, tokens, markers) a call of this size is padded to and replayed at, or None: a call too
        large to gain from a graph runs plain at its own shape (its padding would cost GPU time)."""
        shape = ranges.call_shape(rows, tokens, markers)
        return shape if shape[0] * shape[1] <= self.max_tokens else None

    def __call__(self, *inputs: torch.Tensor, out_device: Optional[torch.device] = None) -> List[torch.Tensor]:
        """`fn`'s outputs for `inputs`, on `out_device` (None: where `fn` leaves them). A replay copies inputs from
        wherever they are straight into its static buffers, and its outputs straight to `out_device`."""
        key = _key(inputs)
        self._calls += 1
        if self._budget_at is None:  # the capture budget's share counts from the first call
            self._budget_at = self._clock()
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            self._used[key] = self._calls
            self._counts["replays"] += 1
            return graph.replay(inputs, out_device)
        given = inputs
        if self.device is not None:
            inputs = tuple(x.to(self.device) for x in inputs)
        out = list(self._fn(*inputs))
        if key in self._refused:
            self._counts["plain_refused"] += 1
        elif not self.eligible(inputs):
            self._counts["plain_large"] += 1
        elif self._recurs(key) and self._affordable() and self._room():
            t0 = self._clock()
            self._capture(key, inputs, out, given, out_device)
            spent = self._clock() - t0
            self._capture_s += spent
            self._budget -= spent
        return out if out_device is None else [o.to(out_device) for o in out]

    def _recurs(self, key: Key) -> bool:
        """Whether this call's shape came `capture_after` times within `stale_calls` calls (this one included), so
        that its graph would be replayed often enough to repay its capture; otherwise the call is counted
        `plain_rare`."""
        seen = self._seen.get(key)
        if seen is None:
            seen = self._seen[key] = deque(maxlen=self.capture_after)
        seen.append(self._calls)
        if len(seen) == self.capture_after and self._calls - seen[0] < self.stale_calls:
            return True
        self._counts["plain_rare"] += 1
        return False

    def _capture(self, key: Key, inputs: Sequence[torch.Tensor], plain: Sequence[torch.Tensor],
                 given: Sequence[torch.Tensor], out_device: Optional[torch.device]) -> None:
        """Captures `inputs`' shape and checks one replay against the plain call's outputs, the replay taking the
        inputs as the caller gave them (`given`: host ones as every later call passes them) and giving its outputs where
        the caller wants them (`out_device`)."""
        try:
            graph = self._factory(self._fn, inputs, self._pool)
            replayed = graph.replay(given, out_device)
            why = _disagreement([p.to(r.device) for p, r in zip(plain, replayed)], replayed)
        except Exception as e:  # noqa: BLE001 - any capture failure: this shape runs plain calls
            graph, why = None, "capture failed: %s: %s" % (type(e).__name__, e)
            device = inputs[0].device
            if out_of_memory(e, device) and self._short[key] < CAPTURE_TRIES_SHORT_OF_MEMORY - 1:
                # memory short now, perhaps not later: this shape is captured again from its next two calls
                self._short[key] += 1
                self._counts["capture_out_of_memory"] += 1
                self._seen.pop(key, None)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                log.warning("laya-aot: no CUDA graph for inputs %s yet (%s); they run as plain calls until a "
                            "later capture fits", [s for s, _ in key], why)
                return
        if why is not None:
            self._refused[key] = why
            self._counts["refusals"] += 1
            log.warning("laya-aot: no CUDA graph for inputs %s (%s); they run as plain calls",
                        [s for s, _ in key], why)
            return
        self._pool = graph.pool()
        self._seen.pop(key, None)
        self._graphs[key] = graph
        self._used[key] = self._calls
        self._counts["captured"] += 1

    def _affordable(self) -> bool:
        """Whether the capture budget allows a capture now: captures may take `capture_share` of the wall time
        since the first call, plus `capture_burst_s` ahead of it, whatever one costs on this GPU and model.
        Otherwise the call stays plain, counted `plain_capture_budget`, and its shape is captured later."""
        now = self._clock()
        if self._budget_at is not None:
            self._budget = min(self.capture_burst_s, self._budget + self.capture_share * (now - self._budget_at))
        self._budget_at = now
        if self._budget > 0:
            return True
        self._counts["plain_capture_budget"] += 1
        return False

    def _room(self) -> bool:
        """Whether a new graph may be captured: under the cap, or once the least recently replayed graph has gone
        `stale_calls` calls without a replay (it is dropped). Otherwise the call stays plain, counted."""
        if len(self._graphs) < self.max_graphs:
            return True
        oldest = next(iter(self._graphs))
        if self._calls - self._used.get(oldest, 0) < self.stale_calls:
            self._counts["full"] += 1
            return False
        self._graphs.popitem(last=False)
        self._used.pop(oldest, None)
        self._counts["evicted"] += 1
        return True

    @property
    def stats(self) -> Dict[str, Any]:
        out: Dict[str, Any] = dict(self._counts, graphs=len(self._graphs))
        if self._capture_s:
            out["capture_s"] = round(self._capture_s, 3)
        if self._refused:
            out["refused"] = {"x".join(map(str, k[0][0])): why for k, why in self._refused.items()}
        return out

"""CUDA graphs for an artifact's small calls, where kernel launches, not the GPU, set the latency.

At 1 row x 128 tokens a 28-layer encoder is a few hundred short kernels: the GPU waits on the
CPU launching them. A CUDA graph replays the whole forward with one launch. A call is replayed only when
it is small (`max_tokens` rows x tokens); the backend pads such a call to its stepped shape first
(`shape_for`: `padding.Ranges.call_shape`), so that a service's merged calls of any size take a few
fixed shapes, each captured once, rather than one graph per row count (a dynamic batcher's calls take
every size: 16 graphs of the sizes just seen were captured and evicted in turn, each capture stopping
the GPU). A shape is captured on its second call (the first one warms it, so nothing loads lazily
during capture); at most `max_graphs` are kept, and one is dropped for a new shape only when no call
has replayed it for `stale_calls` calls: a working set of shapes larger than the cap leaves the rest to
plain calls instead of capturing and evicting in turn. Each capture is checked against the plain call
it replaces; a capture that fails or disagrees turns graphs off for that shape, with the reason in
`stats`.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import out_of_memory

log = logging.getLogger(__name__)

MAX_TOKENS = 8192
# graphs kept: the stepped shapes a service's calls take (padding.step_up: 20 row counts up to 64, for each of
# its token steps) fit; every graph shares one memory pool (the largest call's activations), so each one more
# costs its static inputs and outputs and the graph's own host memory
MAX_GRAPHS = 64
STALE_CALLS = 1024  # calls without a replay after which a graph may make room for a new shape
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
        # one capture at a time in the process (torch.cuda.graph synchronizes and empties the allocator's
        # cache on entry), each on a side stream of its own GPU: torch.cuda.graph's default capture stream
        # is made once per process, on the GPU current at the first capture, so a second GPU's capture
        # failed with "invalid resource handle" (two-GPU run)
        with _CAPTURE_LOCK, torch.cuda.device(self.device):
            self.inputs = [x.clone() for x in inputs]
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: another thread of the service using CUDA meanwhile does not break the capture
            with torch.cuda.graph(self.graph, pool=pool, stream=_capture_stream(self.device),
                                  capture_error_mode="thread_local"):
                self.outputs = list(fn(*self.inputs))

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
    """Calls `fn(*tensors)`; small shapes seen twice are captured and replayed as CUDA graphs.

    Not thread-safe by itself: the runner that owns it serialises calls (as AOTIRunner does).
    `graph_factory` exists for tests on machines without CUDA.
    """

    def __init__(self, fn: Fn, max_tokens: int = MAX_TOKENS, max_graphs: int = MAX_GRAPHS,
                 graph_factory: Callable[[Fn, Sequence[torch.Tensor], Any], Any] = _Graph,
                 device: Optional[torch.device] = None, stale_calls: int = STALE_CALLS):
        self._fn = fn
        self.device = device  # where `fn` takes its inputs (None: they come there already)
        self.max_tokens = max_tokens
        self.max_graphs = max_graphs
        self.stale_calls = stale_calls
        self._factory = graph_factory
        self._graphs: "OrderedDict[Key, Any]" = OrderedDict()
        self._used: Dict[Key, int] = {}  # the call count at each graph's last replay (or capture)
        self._calls = 0
        self._seen: Counter = Counter()
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
        if key not in self._refused and self.eligible(inputs):
            self._seen[key] += 1
            if self._seen[key] >= 2 and self._room():
                self._capture(key, inputs, out, given, out_device)
        return out if out_device is None else [o.to(out_device) for o in out]

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
                self._seen[key] = 0
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
        self._graphs[key] = graph
        self._used[key] = self._calls
        self._counts["captured"] += 1

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
        if self._refused:
            out["refused"] = {"x".join(map(str, k[0][0])): why for k, why in self._refused.items()}
        return out

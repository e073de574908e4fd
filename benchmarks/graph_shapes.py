"""The Batcher's artifact calls against the CUDA graph policy (`kinds/graphs.py`), on the CPU (issue 59).

The GPU run that showed the mixed stream collapsing under load cannot run here, but the calls that reach the
runner can: laya's eager agent of a checkpoint (`laya-aot make-demo --shape hd64-bf16-ctx1024`: a 1,024-token
context, so lengths vary as on the GPU) with `AOTBackend` over a stand-in runner whose GPU is a clock. Each call
sleeps for what it would cost on an H100 serving `large-1024` (the cost model below, from the build's figures; an
assumption, not a measurement), so the batcher forms calls as it does when the GPU is busy for that long. The
counts (distinct call shapes, captures, replays, plain calls by reason, cells computed against real tokens) are
this simulation's; the requests/s are only the cost model's.

    laya-aot make-demo /tmp/w/ckpt-hd64 --shape hd64-bf16-ctx1024
    python benchmarks/graph_shapes.py --checkpoint /tmp/w/ckpt-hd64 --capture-ms 200

`--capture-ms` is what one capture costs in the model (unknown until a GPU run reports `capture_s` over
`captured`); `--max-tokens`, `--capture-after` and `--capture-share` set the policy's knobs (`--capture-share
1e9` turns the capture budget off).

The streams run as `http_load.py --python` runs them for the Batcher: each request alone first, a warm-up of
`--warmup` seconds at each level, then each level for `--seconds`, all against one runner (its graphs kept).
Writes graph_shapes<tag>.json and .md to --out.
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any, Dict, List, Sequence, Tuple

import harness

sys.path.insert(0, str(harness.ROOT))

import torch  # noqa: E402

# the cost model (milliseconds; H100, large-1024 in bf16, `laya-aot inspect`'s build latencies 1.85 ms @1x128x4,
# 4.51 ms @8x256x4, 30.30 ms @32x512x4, and a plain call's launches 5.26 ms against a replay's 1.59 ms at 1x128 on
# an H200): GPU time grows with the cells computed; a plain call costs at least its launches; a capture costs a
# plain call's launches, the graph's instantiation and a checking replay (CAPTURE_MS: a guess, --capture-ms)
GPU_MS = 0.8
GPU_MS_PER_CELL = 0.0018
LAUNCH_MS = 5.0
CAPTURE_MS = 60.0


def gpu_ms(cells: int) -> float:
    return GPU_MS + GPU_MS_PER_CELL * cells


class Clock:
    """The stand-in GPU: calls sleep for the cost model's time and give zeros of the artifact's output shapes."""

    def __init__(self, actions: int, scale: float, capture_ms: float = CAPTURE_MS):
        self.actions = actions
        self.capture_ms = capture_ms
        self.scale = scale
        self.log: List[Tuple[str, Tuple[int, int, int]]] = []  # (what, call shape) per runner call

    def outputs(self, ids: torch.Tensor, mpos: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        n = ids.shape[0]
        return torch.zeros(n, mpos.shape[1]), torch.zeros(n, self.actions)

    def sleep(self, ms: float) -> None:
        time.sleep(ms * self.scale / 1000.0)

    def plain(self, ids, att, mpos, mmask, qtype):
        self.log.append(("plain", (ids.shape[0], ids.shape[1], mpos.shape[1])))
        self.sleep(max(LAUNCH_MS, gpu_ms(ids.numel())))
        return self.outputs(ids, mpos)


class SimGraph:
    """A capture that costs CAPTURE_MS and replays at the GPU's time alone."""

    def __init__(self, clock: Clock, inputs: Sequence[torch.Tensor]):
        self.clock = clock
        self.shape = (inputs[0].shape[0], inputs[0].shape[1], inputs[2].shape[1])
        clock.log.append(("capture", self.shape))
        clock.sleep(clock.capture_ms)

    def replay(self, inputs: Sequence[torch.Tensor], out_device: Any = None) -> List[torch.Tensor]:
        self.clock.log.append(("replay", self.shape))
        self.clock.sleep(gpu_ms(inputs[0].numel()))
        return list(self.clock.outputs(inputs[0], inputs[2]))

    def pool(self) -> None:
        return None


class Runner:
    """What AOTBackend calls: an AOTIRunner's interface, its graphs a `GraphedCalls` over the clock."""

    takes_host_inputs = True

    def __init__(self, clock: Clock, **graph_kw: Any):
        from laya_aot.kinds.graphs import GraphedCalls

        self.device = torch.device("cpu")
        self.clock = clock
        self.graphs = GraphedCalls(clock.plain, graph_factory=lambda fn, inputs, pool: SimGraph(clock, inputs),
                                   **graph_kw)

    def __call__(self, *inputs: torch.Tensor):
        return tuple(self.graphs(*inputs, out_device=inputs[0].device))


def agent_with_clock(ckpt: str, scale: float, capture_ms: float = CAPTURE_MS,
                     **graph_kw: Any) -> Tuple[Any, Any, Clock]:
    """laya's eager agent of `ckpt` with AOTBackend over the clock installed (ranges as a GPU bundle's)."""
    import laya

    from laya_aot.padding import Ranges
    from laya_aot.runtime.backend import AOTBackend

    agent = laya.load(ckpt, device="cpu")
    clock = Clock(agent.model.act_head[-1].out_features, scale, capture_ms)
    ranges = Ranges(min_rows=1, max_rows=64, min_tokens=16, max_tokens=1024, min_markers=2, max_markers=64)
    art = SimpleNamespace(kind="aoti", name="clock", variant=None, verify=None, ranges=ranges)
    backend = AOTBackend(agent, Runner(clock, **graph_kw), art, pad_id=agent.tok.pad_token_id)
    backend.install()
    return agent, backend, clock


def counts(backend: Any, clock: Clock, since: int, reals: List[int]) -> Dict[str, Any]:
    """What the runner saw since log entry `since`: calls by kind, distinct shapes, cells against real tokens."""
    log = clock.log[since:]
    kinds = Counter(what for what, _ in log)
    calls = [s for what, s in log if what != "capture"]
    per_shape = Counter(calls)
    return {"shapes_called_2_to_7": sum(1 for n in per_shape.values() if 2 <= n < 8),
            "shapes_called_8_or_more": sum(1 for n in per_shape.values() if n >= 8),
            "calls_of_shapes_called_once": sum(1 for n in per_shape.values() if n == 1),
            "calls_over_2048_cells": sum(1 for r, t, _ in calls if r * t > 2048),
            "runner_calls": len(calls), "distinct_shapes": len(set(calls)), "captures": kinds["capture"],
            "replays": kinds["replay"], "plain": kinds["plain"],
            "captures_per_100_calls": round(100.0 * kinds["capture"] / max(1, len(calls)), 2),
            "cells": sum(r * t for r, t, _ in calls), "real_tokens": sum(reals),
            "cells_per_real_token": round(sum(r * t for r, t, _ in calls) / max(1, sum(reals)), 3)}


def replays_per_capture(log: List[Tuple[str, Tuple[int, int, int]]]) -> Dict[str, int]:
    """Captures by the replays that followed each (until the shape's next capture or the run's end): how many
    captures a run's replays repaid."""
    replays: List[int] = []
    open_: Dict[Tuple[int, int, int], int] = {}
    for what, shape in log:
        if what == "capture":
            if shape in open_:
                replays.append(open_[shape])
            open_[shape] = 0
        elif what == "replay" and shape in open_:
            open_[shape] += 1
    replays += open_.values()
    return {"0-3": sum(1 for n in replays if n < 4), "4-15": sum(1 for n in replays if 4 <= n < 16),
            "16+": sum(1 for n in replays if n >= 16)}


def run(a: Any) -> Dict[str, Any]:
    from http_load import _callers, mixed_requests, short_requests

    from laya_aot.runtime.batcher import Batcher

    policy = {k: v for k, v in (("max_tokens", a.max_tokens), ("capture_after", a.capture_after),
                                ("capture_share", a.capture_share)) if v is not None}
    agent, backend, clock = agent_with_clock(a.checkpoint, a.scale, a.capture_ms, **policy)
    reals: List[int] = []
    forward = backend.forward

    def record(ids, att, *rest, **kw):
        reals.append(int(att.sum()))
        return forward(ids, att, *rest, **kw)

    backend.model.forward = record
    out: Dict[str, Any] = {"streams": {}}
    streams = {"short": short_requests(), "mixed": mixed_requests(a.checkpoint)}
    with Batcher(agent) as batcher:
        def submit(r: Dict[str, Any]) -> Any:
            return batcher.submit(r["state"], r["questions"]).result()

        for name in a.streams.split(","):
            reqs = streams[name]
            for r in reqs:
                submit(r)
            for c in a.callers:
                _callers(submit, reqs, c, a.warmup)
            levels = []
            for c in a.callers:
                mark, real0 = len(clock.log), len(reals)
                lv = _callers(submit, reqs, c, a.seconds)
                lv.pop("answers")
                lv.update(counts(backend, clock, mark, reals[real0:]))
                levels.append(lv)
                print("%-6s %4d callers: %6.1f req/s (cost model)  calls %4d  shapes %3d  captures %3d  replays %4d  "
                      "plain %4d  cells/real %.2f" % (name, c, lv["rps"], lv["runner_calls"], lv["distinct_shapes"],
                                                      lv["captures"], lv["replays"], lv["plain"],
                                                      lv["cells_per_real_token"]), flush=True)
            out["streams"][name] = levels
    out["graph_stats"] = backend.stats.get("cuda_graphs")
    out["replays_per_capture"] = replays_per_capture(clock.log)
    out["backend_stats"] = {k: v for k, v in backend.stats.items() if k != "cuda_graphs"}
    print("graphs:", out["graph_stats"], "replays per capture:", out["replays_per_capture"], flush=True)
    return out


def markdown(r: Dict[str, Any]) -> str:
    rows = ["| stream | callers | requests/s (cost model) | runner calls | distinct shapes | captures | "
            "captures per 100 calls | replays | plain | cells per real token |", "|---" * 10 + "|"]
    for name, levels in r["streams"].items():
        for lv in levels:
            rows.append("| %s | %d | %s | %d | %d | %d | %s | %d | %d | %s |" % (
                name, lv["callers"], lv["rps"], lv["runner_calls"], lv["distinct_shapes"], lv["captures"],
                lv["captures_per_100_calls"], lv["replays"], lv["plain"], lv["cells_per_real_token"]))
    return "\n".join(rows) + "\n\nGraph stats over the run: %s; captures by the replays that followed them: %s\n" % (
        r["graph_stats"], r["replays_per_capture"])


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--checkpoint", required=True, help="a Laya checkpoint dir (make-demo --shape hd64-bf16-ctx1024)")
    p.add_argument("--streams", default="short,mixed")
    p.add_argument("--callers", default="1,8,32")
    p.add_argument("--seconds", type=float, default=2.5)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--scale", type=float, default=1.0, help="the cost model's times multiplied by this")
    p.add_argument("--capture-ms", type=float, default=CAPTURE_MS, help="what one capture costs (the cost model)")
    p.add_argument("--max-tokens", type=int, default=None, help="GraphedCalls' max_tokens (default: its own)")
    p.add_argument("--capture-after", type=int, default=None, help="GraphedCalls' capture_after (default: its own)")
    p.add_argument("--capture-share", type=float, default=None,
                   help="GraphedCalls' capture_share (default: its own; 1e9 turns the budget off)")
    a = p.parse_args()
    a.callers = [int(c) for c in a.callers.split(",")]
    result = dict(run(a), checkpoint=a.checkpoint, seconds=a.seconds, warmup=a.warmup, scale=a.scale,
                  max_tokens=a.max_tokens or "default", capture_after=a.capture_after or "default",
                  cost_model={"gpu_ms": GPU_MS, "gpu_ms_per_cell": GPU_MS_PER_CELL, "launch_ms": LAUNCH_MS,
                              "capture_ms": a.capture_ms})
    harness.write(a.out, "graph_shapes" + a.tag, result, markdown(result),
                  title="The Batcher's artifact calls against the CUDA graph policy, simulated on the CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())

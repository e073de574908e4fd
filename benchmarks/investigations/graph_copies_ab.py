"""A CUDA graph's replay with packed, pinned copies against the per-tensor copies it replaced (session 35).

Before: each of the five host inputs copied from pageable memory into its static buffer, the two outputs copied
back the same way (seven synchronous copies). Now (`kinds/graphs._Graph`): the static inputs are views of one
device buffer with a pinned host twin, filled on the host and sent in one asynchronous copy, the outputs copied
to pinned memory with one wait. This loads the bundle once and times, interleaved in alternating blocks, the same
captured graphs with each replay (the old one restored here by patching `_Graph.replay`):

- the agent's 1x1 call and a 4x1 call (`predict_batch`, wall clock: each returns answers on the host);
- the runner alone at 1x128x4 and 8x256x4 (host inputs, as the backend passes them).

Outputs of the two replays on the same inputs must be equal (the same graph on the same values).

Usage (after the site unpack line):
    python3 benchmarks/investigations/graph_copies_ab.py CKPT BUNDLE OUT.json [--rounds 8] [--calls 60]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_start import ONE, states  # noqa: E402  (a sibling benchmark script)

from laya_aot.kinds import graphs  # noqa: E402
from laya_aot.padding import batch_of_shape  # noqa: E402

NEW = graphs._Graph.replay


def old_replay(self, inputs, out_device=None):
    """main 59d6b7b's replay: each input copied into its static buffer, each output copied back."""
    with torch.cuda.device(self.device):
        for dst, src in zip(self.inputs, inputs):
            dst.copy_(src)
        self.graph.replay()
        if out_device is None or torch.device(out_device) == self.device:
            return [o.clone() for o in self.outputs]
        return [o.to(out_device) for o in self.outputs]


def timed(fn, n: int) -> list:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("bundle")
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=60)
    a = ap.parse_args()
    import laya_aot

    agent = laya_aot.load(a.ckpt, bundle=a.bundle, device="cuda")
    runner = agent.backend_object.runner
    one, four = states(1, 20, seed=1), states(4, 60, seed=2)
    shapes = {"fwd_1x128x4": batch_of_shape(1, 128, 4), "fwd_8x256x4": batch_of_shape(8, 256, 4)}
    work = {"call_1x1": lambda: agent.predict_batch(one, ONE), "call_4x1": lambda: agent.predict_batch(four, ONE)}
    for name, b in shapes.items():
        work[name] = (lambda b=b: runner(*b))
    for fn in work.values():  # capture every shape (a graph on the second call), then warm
        for _ in range(5):
            fn()
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "graphs": runner.graphs.stats,
           "equal_outputs": {}}
    for name, b in shapes.items():
        graphs._Graph.replay = old_replay
        before = [o.clone() for o in runner(*b)]
        graphs._Graph.replay = NEW
        after = runner(*b)
        res["equal_outputs"][name] = all(torch.equal(x, y) for x, y in zip(before, after))
    times = {m: {k: [] for k in work} for m in ("old", "new")}
    for r in range(a.rounds):
        for m in (("old", "new") if r % 2 == 0 else ("new", "old")):
            graphs._Graph.replay = old_replay if m == "old" else NEW
            for k, fn in work.items():
                times[m][k] += timed(fn, a.calls)
    graphs._Graph.replay = NEW
    res["median_ms"] = {m: {k: round(statistics.median(v), 4) for k, v in d.items()} for m, d in times.items()}
    res["new_over_old"] = {k: round(res["median_ms"]["new"][k] / res["median_ms"]["old"][k], 3) for k in work}
    res["graphs_after"] = runner.graphs.stats
    res["rounds"], res["calls_per_block"] = a.rounds, a.calls
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("equal_outputs", "median_ms", "new_over_old")}, indent=1))


if __name__ == "__main__":
    main()

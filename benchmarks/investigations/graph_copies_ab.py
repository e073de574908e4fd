"""A CUDA graph's replay with packed, pinned copies against the per-tensor copies (session 35; not yet run).

Per-tensor (the default): each of the five host inputs copied from pageable memory into its static buffer, the
two outputs copied back the same way (seven synchronous copies). Pinned (`kinds/graphs._Graph.pinned_copies`):
the static inputs are views of one device buffer with a pinned host twin, filled on the host and sent in one
asynchronous copy, the outputs copied to pinned memory with one wait. This loads the bundle once, captures every
shape under each setting (two sets of graphs in one runner), and times them interleaved in alternating blocks:

- the agent's 1x1 call and a 4x1 call (`predict_batch`, wall clock: each returns answers on the host);
- the runner alone at 1x128x4 and 8x256x4 (host inputs, as the backend passes them).

Outputs of the two graphs of a shape on the same inputs must be equal (the same kernels on the same values).

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

MODES = {"per_tensor": False, "pinned": True}


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
    calls = runner.graphs
    sets = {}
    for mode, pinned in MODES.items():  # each setting's graphs, captured on a shape's second call, then warmed
        graphs._Graph.pinned_copies = pinned
        calls._graphs.clear()
        calls._seen.clear()
        for fn in work.values():
            for _ in range(5):
                fn()
        sets[mode] = calls._graphs.copy()
    graphs._Graph.pinned_copies = False
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "graphs": calls.stats,
           "graphs_per_setting": {m: len(g) for m, g in sets.items()}, "equal_outputs": {}}
    for name, b in shapes.items():
        outs = {}
        for mode in MODES:
            calls._graphs = sets[mode].copy()
            outs[mode] = [o.clone() for o in runner(*b)]
        res["equal_outputs"][name] = all(torch.equal(x, y) for x, y in zip(*outs.values()))
    times = {m: {k: [] for k in work} for m in MODES}
    for r in range(a.rounds):
        for m in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
            calls._graphs = sets[m].copy()
            for k, fn in work.items():
                times[m][k] += timed(fn, a.calls)
    res["median_ms"] = {m: {k: round(statistics.median(v), 4) for k, v in d.items()} for m, d in times.items()}
    res["pinned_over_per_tensor"] = {k: round(res["median_ms"]["pinned"][k] / res["median_ms"]["per_tensor"][k], 3)
                                     for k in work}
    res["graphs_after"] = runner.graphs.stats
    res["rounds"], res["calls_per_block"] = a.rounds, a.calls
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("equal_outputs", "median_ms", "pinned_over_per_tensor")}, indent=1))


if __name__ == "__main__":
    main()

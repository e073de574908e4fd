"""Artifact calls at once on one GPU: a bundle's forward with 1..N instances of its artifact (`AOTIRunner.widen`),
each instance called from a thread of its own, as the engine's device threads call it (`LAYA_AOT_ENGINE_INSTANCES`).

    python benchmarks/instances.py --ckpt CKPT --bundle BUNDLE --instances 1,2,3 --shapes 17x64,32x64,1x64 \
        --seconds 3

Loads the bundle with `laya_aot.load` and calls its backend's `forward` (padding, stepping, CUDA graphs: what the
engine calls) with seeded batches of each shape: first one call at a time, which gives every batch's outputs alone,
then with each instance count (the runner widened in turn; an instance is never dropped) for `--seconds` per shape,
as many threads as instances, each calling in a loop. Per shape and count: rows and calls a second, the median
call, and how many calls' outputs differ from the same batch alone (bit for bit: the same kernels run on the same
inputs whichever instance runs them). Writes instances<tag>.json and .md to --out.
"""
from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import harness


def measure(backend: Any, batches: List[tuple], alone: List[tuple], threads: int, seconds: float) -> Dict[str, Any]:
    """`threads` threads calling `backend.forward` on `batches` in turn for `seconds`."""
    import torch

    lock = threading.Lock()
    times: List[float] = []
    counts = {"calls": 0, "rows": 0, "differ": 0, "errors": 0}
    stop = time.perf_counter() + seconds

    def worker(t: int) -> None:
        i = t
        while time.perf_counter() < stop:
            k = i % len(batches)
            i += threads
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    out = backend.forward(*batches[k])
            except Exception:  # noqa: BLE001 - counted, and the run goes on
                with lock:
                    counts["errors"] += 1
                continue
            dt = time.perf_counter() - t0
            same = all(torch.equal(o.cpu(), a) for o, a in zip(out, alone[k]))
            with lock:
                times.append(dt)
                counts["calls"] += 1
                counts["rows"] += batches[k][0].shape[0]
                counts["differ"] += 0 if same else 1

    t0 = time.perf_counter()
    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for p in pool:
        p.start()
    for p in pool:
        p.join()
    wall = time.perf_counter() - t0
    return dict(counts, rows_per_s=round(counts["rows"] / wall, 1), calls_per_s=round(counts["calls"] / wall, 1),
                call_p50_ms=round(1000 * statistics.median(times), 3) if times else None)


def markdown(res: Dict[str, Any]) -> str:
    lines = ["Forward rows a second with N instances, each called from its own thread (rows x tokens, 4 markers; "
             "%g s per level; `differ`: calls whose outputs are not bit for bit the batch's alone)." % res["seconds"],
             "", "| shape | instances | rows/s | calls/s | call p50 ms | x one instance | differ | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for shape, levels in res["shapes"].items():
        base = levels[0]["rows_per_s"] or 1.0
        for lv in levels:
            lines.append("| %s | %d | %.0f | %.0f | %s | %.2fx | %d / %d | %d |" % (
                shape, lv["instances"], lv["rows_per_s"], lv["calls_per_s"], lv["call_p50_ms"],
                lv["rows_per_s"] / base, lv["differ"], lv["calls"], lv["errors"]))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--instances", default="1,2,3", help="instance counts, increasing")
    ap.add_argument("--shapes", default="17x64,32x64,1x64", help="rows x tokens of the calls")
    ap.add_argument("--batches", type=int, default=8, help="distinct seeded batches per shape")
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()

    import torch
    from safetensors.torch import load_file

    import laya_aot

    agent = laya_aot.load(a.ckpt, bundle=a.bundle, device=a.device)
    backend = agent.backend_object
    runner = backend.runner
    vocab = harness.vocab_of(load_file(str(Path(a.ckpt) / "model.safetensors")))
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",") if s]
    batches: Dict[str, List[tuple]] = {}
    alone: Dict[str, List[tuple]] = {}
    for rows, tokens in shapes:
        key = "%dx%d" % (rows, tokens)
        batches[key] = [harness.forward_args(rows, tokens, vocab, "cpu", seed=1000 * rows + tokens + i)
                        for i in range(a.batches)]
        with torch.no_grad():
            for _ in range(3):  # the first call of a shape warms it, the second captures its graph
                outs = [tuple(o.cpu() for o in backend.forward(*b)) for b in batches[key]]
        alone[key] = outs
    res: Dict[str, Any] = {"backend": backend.name, "artifact": backend.artifact.name, "seconds": a.seconds,
                           "shapes": {}, "widen_s": {}}
    for n in [int(x) for x in a.instances.split(",") if x]:
        t0 = time.perf_counter()
        got = runner.widen(n) if n > 1 else 1
        res["widen_s"][n] = round(time.perf_counter() - t0, 3)
        for key in batches:
            measure(backend, batches[key], alone[key], got, min(1.0, a.seconds))  # new instances warm their graphs
            level = dict(measure(backend, batches[key], alone[key], got, a.seconds), instances=got)
            res["shapes"].setdefault(key, []).append(level)
            print(key, level, flush=True)
    res["graphs"] = backend.stats.get("cuda_graphs")
    harness.write(a.out, "instances" + a.tag, res, markdown(res), title="Artifact calls at once on one GPU")


if __name__ == "__main__":
    main()

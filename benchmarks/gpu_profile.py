"""Where a realistic call's time goes, against the GPU's compute limit, and what the peak of a long forward holds.

With the checkpoint and bundle `gpu_start.py` made:

    python3 benchmarks/gpu_profile.py --ckpt DIR --bundle DIR [--tag _a] [--paths ...] [--cprofile] [--kernels]

One process per path (`--paths`: laya eager; the bundle as `laya_aot.load` leaves it; `bundle_stock_host`, the
bundle with `host_path=False`; `bundle:OPTION=N`, the bundle with that integer load option). For each of
`gpu_start.py`'s three realistic calls, median of 15 after 3 warm-ups:
- **total**: `predict_batch`, synchronised;
- **forward**: the agent's model forward (laya's DecisionModel, or the installed artifact with its padding,
  chunking and copies), synchronised on entry and exit; **host** = total - forward (laya's tokenising,
  windows, packing, post-processing);
- **artifact** (bundle only): the artifact's own calls inside the forward;
- the tokens the forward computed (rows x padded length, every chunk) and the **dense 16-bit limit**: the
  matmul FLOPs of the checkpoint's linear layers plus attention's (2 x linear params + 4 x layers x hidden x
  padded length, per token) at `--tflops` (the H200's data-sheet dense bf16 rate, 790).
Then the forward alone at the forward-only shapes (1x128x4, 8x256x4, 32x512x4, 32x1024x4; median of 20), with
`--cprofile` the 25 functions with the most own time in 20 of each call (cprofile_<shape><tag>.txt), and one
32 x 1024 forward with torch's allocator history on: the peak, and the largest blocks live at it.
The synchronisation adds a little to what it measures; `gpu_start.py` times the calls without it.
Writes profile_<shape><tag>.json and .md to --out.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import harness
from harness import CALLS, FORWARD_SHAPES, states


def linear_params(ckpt: str) -> tuple:
    """(params of the encoder's and head's 2-D weights except embeddings, layers, hidden) from the checkpoint."""
    from safetensors import safe_open

    n = 0
    with safe_open(str(Path(ckpt) / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            shape = f.get_slice(k).get_shape()
            if len(shape) == 2 and "embeddings" not in k:
                n += shape[0] * shape[1]
    enc = json.loads((Path(ckpt) / "encoder" / "config.json").read_text())
    return n, int(enc["num_hidden_layers"]), int(enc["hidden_size"])


REPEATS = 15  # --repeats: timed calls per realistic call, after 3 warm-ups
SELECTED = tuple(c[0] for c in CALLS)  # --calls: which of gpu_start's realistic calls run
KERNELS = False  # --kernels: torch.profiler over the forward-only shapes
DEVICE = "cuda"  # --device: "cpu" profiles a CPU bundle the same way (no dense limit, no allocator trace)


def _sync() -> None:
    harness.synchronizer(DEVICE)()


class _Timed:
    """A callable timed with CUDA synchronisation on entry and exit; records seconds and input shapes."""

    def __init__(self, fn, log: list):
        self.fn, self.log = fn, log

    def __call__(self, *a, **k):

        _sync()
        t = time.perf_counter()
        out = self.fn(*a, **k)
        _sync()
        ids = a[0] if a else k["input_ids"]
        self.log.append((time.perf_counter() - t, tuple(ids.shape)))
        return out

    def __getattr__(self, name):  # the runner's own attributes (device, stats, graphs)
        return getattr(self.fn, name)


def child(path: str, ckpt: str, bundle: str, tflops: float, cprofile: bool = False,
          forward_shapes: tuple = FORWARD_SHAPES) -> None:

    if path in ("eager", "eager_fast"):  # eager_fast: laya's own fast path (TileLang kernels, compiled at load)
        import laya

        agent = laya.load(ckpt, device=DEVICE, **({"fast": True} if path == "eager_fast" else {}))
    else:
        import laya_aot

        # "bundle" = load's defaults; "bundle_stock_host" = host_path=False; "bundle:chunk_tokens=0" = a load option
        name, _, option = path.partition(":")
        kwargs = {k: int(v) for k, v in (option.split("="),)} if option else {}
        agent = laya_aot.load(ckpt, bundle=bundle, device=DEVICE, strict=True, host_path=name == "bundle", **kwargs)
    params, layers, hidden = linear_params(ckpt)
    fwd_log: list = []
    art_log: list = []
    agent.model.forward = _Timed(agent.model.forward, fwd_log)
    bo = getattr(agent, "backend_object", None)
    if not path.startswith("eager"):
        bo.runner = _Timed(bo.runner, art_log)
    res = {"path": path, "backend": agent.backend, "linear_params": params, "layers": layers, "hidden": hidden,
           "tflops": tflops, "calls": {}}
    for name, n, words, qs in CALLS:
        if name not in SELECTED:
            continue
        st = states(n, words)
        for _ in range(3):
            agent.predict_batch(st, qs)
        rows = []
        for _ in range(REPEATS):
            fwd_log.clear()
            art_log.clear()
            _sync()
            t = time.perf_counter()
            agent.predict_batch(st, qs)
            _sync()
            total = time.perf_counter() - t
            shapes = [s for _, s in (fwd_log if path.startswith("eager") else art_log)]
            tokens = sum(r * L for r, L in shapes)
            flops = sum(r * L * (2 * params + 4 * layers * hidden * L) for r, L in shapes)
            rows.append({"total_ms": total * 1e3, "forward_ms": sum(s for s, _ in fwd_log) * 1e3,
                         "artifact_ms": sum(s for s, _ in art_log) * 1e3, "tokens": tokens,
                         "limit_ms": flops / (tflops * 1e12) * 1e3 if tflops else 0.0, "shapes": shapes})
        med = {k: round(statistics.median(r[k] for r in rows), 3)
               for k in ("total_ms", "forward_ms", "artifact_ms", "tokens", "limit_ms")}
        med["host_ms"] = round(med["total_ms"] - med["forward_ms"], 3)
        med["host_share"] = round(med["host_ms"] / med["total_ms"], 3)
        med["forward_over_limit"] = round(med["forward_ms"] / med["limit_ms"], 2) if med["limit_ms"] else None
        med["shapes"] = rows[-1]["shapes"]
        res["calls"][name] = med
    res["forward_only"] = forward_only(agent, forward_shapes)
    if KERNELS and DEVICE == "cuda":
        res["kernels"] = kernel_profile(agent, forward_shapes)
    if cprofile:
        res["cprofile"] = host_profile(agent)
    res["peak"] = peak_blocks(agent) if DEVICE == "cuda" else None
    harness.emit(res)

def forward_only(agent, shapes=FORWARD_SHAPES) -> dict:
    """The agent's model forward alone at the forward-only shapes (seeded token ids, 4 markers): median of 20 after
    3 warm-ups, synchronised, under the agent's autocast as laya runs it."""
    import torch

    out = {}
    for rows, length in shapes:
        args = forward_args(rows, length, _vocab(agent))

        def forward(args=args):
            with torch.no_grad(), torch.autocast(DEVICE, dtype=agent.dtype, enabled=agent.amp_enabled):
                agent.model(*args)

        out["%dx%dx4" % (rows, length)] = harness.median_ms(forward, device=DEVICE)
    return out


def _vocab(agent) -> int:
    return int(getattr(getattr(getattr(agent.model, "encoder", None), "config", None), "vocab_size", 4000))


def forward_args(rows: int, length: int, vocab: int = 4000) -> tuple:
    return harness.forward_args(rows, length, vocab, DEVICE, seed=rows * 10000 + length)


def kernel_profile(agent, shapes=FORWARD_SHAPES) -> dict:
    """torch.profiler over 5 forwards at each shape (after 3 warm-ups): the kernels by their own GPU time, and the
    sum of all kernels' time per forward beside the wall time (a forward whose wall time is far above its
    kernels' is bound by launches, not by compute)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for rows, length in shapes:
        args = forward_args(rows, length, _vocab(agent))
        with torch.no_grad(), torch.autocast(DEVICE, dtype=agent.dtype, enabled=agent.amp_enabled):
            for _ in range(3):
                agent.model(*args)
            _sync()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                for _ in range(5):
                    agent.model(*args)
                _sync()
                wall = (time.perf_counter() - t) / 5
        ka = prof.key_averages()
        dev_total = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in ka) / 5
        try:
            table = ka.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=90)
        except Exception:  # noqa: BLE001 - an older torch names the column after CUDA
            table = ka.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90)
        out["%dx%dx4" % (rows, length)] = {"wall_ms": round(wall * 1e3, 3), "kernels_ms": round(dev_total / 1e3, 3),
                                           "table": table}
    return out


def host_profile(agent) -> dict:
    """cProfile of 20 calls of each realistic call: the 25 functions with the most time of their own."""
    import cProfile
    import io
    import pstats

    out = {}
    for name, n, words, qs in CALLS:
        if name not in SELECTED:
            continue
        st = states(n, words)
        agent.predict_batch(st, qs)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            agent.predict_batch(st, qs)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        out[name] = buf.getvalue()
    return out


def peak_blocks(agent) -> dict:
    """One 32 x 1024 forward under the allocator's history: the peak over what was resident, and the largest
    blocks live at that peak (replayed from the trace)."""
    import torch

    args = harness.forward_args(32, 1024, _vocab(agent), "cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    with torch.no_grad(), torch.autocast("cuda", dtype=agent.dtype, enabled=agent.amp_enabled):
        agent.model(*args)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live: dict = {}
    best, at_best = 0, {}
    for ev in snap.get("device_traces", [[]])[0]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev["size"]
        elif ev["action"] in ("free_requested", "free_completed"):
            live.pop(ev["addr"], None)
        total = sum(live.values())
        if total > best:
            best, at_best = total, dict(live)
    top = sorted(at_best.values(), reverse=True)[:12]
    return {"resident_gb": round(base / 1e9, 3), "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
            "over_resident_gb": round((torch.cuda.max_memory_allocated() - base) / 1e9, 3),
            "largest_blocks_at_peak_mb": [round(b / 1e6, 1) for b in top],
            "blocks_at_peak": len(at_best), "live_at_peak_gb": round(best / 1e9, 3)}


def markdown(r: dict) -> str:
    shapes = sorted({k for v in r["paths"].values() for k in (v.get("forward_only") or {})},
                    key=lambda k: tuple(int(x) for x in k.split("x")))
    lines = ["| path | call | total ms | forward ms | artifact ms | host ms (share) | tokens computed | "
             "dense limit ms | forward / limit |", "|---|---|---|---|---|---|---|---|---|"]
    for p, v in r["paths"].items():
        for c, m in (v.get("calls") or {}).items():
            lines.append("| %s | %s | %s | %s | %s | %s (%.0f%%) | %s | %s | %s |" % (
                p, c, m["total_ms"], m["forward_ms"], m["artifact_ms"] or "-", m["host_ms"], 100 * m["host_share"],
                m["tokens"], m["limit_ms"], m["forward_over_limit"]))
    lines += ["", "Forward only (ms, median of 20, synchronised):", "",
              "| path | " + " | ".join(shapes) + " |", "|---|" + "---|" * len(shapes)]
    for p, v in r["paths"].items():
        fo = v.get("forward_only") or {}
        lines.append("| %s | %s |" % (p, " | ".join(str(fo.get(s)) for s in shapes)))
    lines += ["", "| path | resident GB | peak 32x1024 GB | over resident GB | largest blocks at the peak (MB) |",
              "|---|---|---|---|---|"]
    for p, v in r["paths"].items():
        pk = v.get("peak") or {}
        lines.append("| %s | %s | %s | %s | %s |" % (p, pk.get("resident_gb"), pk.get("peak_gb"),
                                                     pk.get("over_resident_gb"), pk.get("largest_blocks_at_peak_mb")))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--child")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--shape", default="large-1024", help="the checkpoint's name in the result files")
    ap.add_argument("--tflops", type=float, default=790.0, help="the device's dense 16-bit rate; 0: no limit column")
    ap.add_argument("--device", default="cuda", help="cpu: a CPU bundle, profiled the same way")
    ap.add_argument("--calls", default=",".join(c[0] for c in CALLS), help="which realistic calls run")
    ap.add_argument("--repeats", type=int, default=15, help="timed calls of each, after 3 warm-ups (median)")
    ap.add_argument("--forward-shapes", default=",".join("%dx%d" % s for s in FORWARD_SHAPES),
                    help="rows x tokens for the forward-only timing (4 markers each)")
    ap.add_argument("--paths", default="eager,bundle,bundle_stock_host",
                    help="eager; eager_fast (laya's fast=True); bundle (laya_aot.load's defaults); bundle_stock_host "
                         "(host_path=False); a path followed by :option=N passes that integer load option "
                         "(bundle:chunk_tokens=0)")
    ap.add_argument("--cprofile", action="store_true", help="also cProfile each call (bundle paths), to cprofile_*.txt")
    ap.add_argument("--kernels", action="store_true",
                    help="also torch.profiler over the forward-only shapes (every path), to kernels_*.txt")
    a = ap.parse_args()
    global DEVICE, REPEATS, SELECTED, KERNELS
    DEVICE, REPEATS, SELECTED, KERNELS = a.device, a.repeats, tuple(a.calls.split(",")), a.kernels
    shapes = tuple(harness.shapes_arg(a.forward_shapes))
    if a.child:
        child(a.child, a.ckpt, a.bundle, a.tflops, a.cprofile, shapes)
        return
    res = {"shape": a.shape, "environment": harness.environment(), "paths": {}}
    for path in a.paths.split(","):
        run = harness.spawn([sys.executable, __file__, "--child", path, "--ckpt", a.ckpt, "--bundle", a.bundle,
                             "--tflops", str(a.tflops), "--device", a.device, "--forward-shapes", a.forward_shapes,
                             "--calls", a.calls, "--repeats", str(a.repeats)]
                            + (["--cprofile"] if a.cprofile and not path.startswith("eager") else [])
                            + (["--kernels"] if a.kernels else []), timeout=1200)
        res["paths"][path] = run.result_or_failure()
        print(path, json.dumps(res["paths"][path])[:1500], flush=True)
    out, stem = a.out, "%s%s" % (a.shape, a.tag)
    harness.write(out, "profile_" + stem, res, markdown(res),
                  title="Where a realistic call's time goes, `%s`" % a.shape)
    profiles = ["## %s, %s\n\n%s" % (p, c, text) for p, v in res["paths"].items()
                for c, text in (v.get("cprofile") or {}).items()]
    if profiles:
        (out / ("cprofile_%s.txt" % stem)).write_text("\n".join(profiles))
    kernels = ["## %s, %s: %.3f ms a forward, kernels %.3f ms\n\n%s" % (p, shape, k["wall_ms"], k["kernels_ms"],
                                                                        k["table"])
               for p, v in res["paths"].items() for shape, k in (v.get("kernels") or {}).items()]
    if kernels:
        (out / ("kernels_%s.txt" % stem)).write_text("\n".join(kernels))


if __name__ == "__main__":
    main()

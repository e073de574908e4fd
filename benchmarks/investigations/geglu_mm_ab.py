"""The GeGLU input projection on a GPU, A/B: cuBLAS's GEMM plus Inductor's fused gelu-multiply (what an
AOTInductor package runs today) against one Triton kernel (`geglu_mm.py` beside this script), at a few tile
configurations. Measured in session 21 (`benchmarks/results/gpu_h200_geglu.md`): the kernel is slower at every
shape, so it stays an investigation and the package keeps cuBLAS + Inductor.

On the GPU host, after the .device-site unpack line:

    python3 benchmarks/investigations/geglu_mm_ab.py --out $OUT [--tag _s21]

Rows x hidden -> intermediate of large-1024 (1024 -> 2 x 2624) and base-512 (768 -> 2 x 1152), bf16 and fp16, at
the row counts a served forward hands the MLP (1 x 80 tokens up to a 16 x 1024 chunk). Each side is timed from a
CUDA graph (`triton.testing.do_bench_cudagraph`, median), as a served call replays it. Correctness: max |diff|
against the fp32 computation, beside the baseline's own.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
import geglu_mm as gm  # noqa: E402  (the kernel beside this script)

WIDTHS = {"large-1024": (1024, 2624), "base-512": (768, 1152)}
ROWS = (80, 128, 512, 2048, 5760, 16384)
CONFIGS = {
    "128x128x64 w8 s3": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    "128x128x64 w8 s4": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    "128x64x64 w4 s4": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    "64x128x64 w4 s4": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    "64x64x64 w4 s4": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    "32x64x128 w4 s3": dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
    "16x64x128 w4 s4": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
}


def bench(fn) -> float:
    return round(float(triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")) * 1e3, 2)  # us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", default="")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--widths", default=",".join(WIDTHS))
    a = ap.parse_args()
    torch.manual_seed(0)
    for knob in ("recompile_limit", "cache_size_limit"):  # one static compile per shape, dtype and width
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 1000)
    baseline = torch.compile(gm.reference, dynamic=False)  # Inductor's default: cuBLAS mm + one pointwise kernel
    rows_out, md = [], []
    for wname in a.widths.split(","):
        hidden, inter = WIDTHS[wname]
        for dt in a.dtypes.split(","):
            dtype = getattr(torch, dt)
            w = (torch.randn(2 * inter, hidden, device="cuda") * hidden ** -0.5).to(dtype)
            for m in ROWS:
                x = torch.randn(m, hidden, device="cuda").to(dtype)
                exact = gm.reference(x.float(), w.float(), None)
                res = {"width": wname, "dtype": dt, "rows": m, "hidden": hidden, "intermediate": inter}
                base = baseline(x, w, None)
                res["baseline_err"] = float((base.float() - exact).abs().max())
                res["baseline_us"] = bench(lambda x=x, w=w: baseline(x, w, None))
                res["mm_only_us"] = bench(lambda x=x, w=w: torch.nn.functional.linear(x, w))
                for cname, cfg in CONFIGS.items():
                    try:
                        out = gm._launch(x, w, None, cfg)
                        err = float((out.float() - exact).abs().max())
                        us = bench(lambda x=x, w=w, cfg=cfg: gm._launch(x, w, None, cfg))
                        res[cname] = {"us": us, "err": err}
                    except Exception as e:  # noqa: BLE001 - a config that does not compile here
                        res[cname] = {"error": "%s: %s" % (type(e).__name__, str(e)[:200])}
                best = min([(v["us"], k) for k, v in res.items() if isinstance(v, dict) and "us" in v] or [(0.0, None)])
                res["best"] = {"config": best[1], "us": best[0],
                               "over_baseline": round(best[0] / res["baseline_us"], 3)}
                print(json.dumps(res), flush=True)
                rows_out.append(res)
    names = list(CONFIGS)
    md.append("# GeGLU input projection: cuBLAS + Inductor pointwise against one Triton kernel (`laya_aot.geglu_mm`)\n")
    md.append("Microseconds per call from a CUDA graph (median); err: max |diff| against fp32.\n")
    md.append("| width | dtype | rows | mm only | baseline (err) | " + " | ".join(names) + " | best / baseline |")
    md.append("|" + "---|" * (6 + len(names)))
    for r in rows_out:
        cells = []
        for n in names:
            v = r[n]
            cells.append("%.2f (%.2g)" % (v["us"], v["err"]) if "us" in v else "error")
        md.append("| %s | %s | %d | %.2f | %.2f (%.2g) | %s | %.3f |" % (
            r["width"], r["dtype"], r["rows"], r["mm_only_us"], r["baseline_us"], r["baseline_err"], " | ".join(cells),
            r["best"]["over_baseline"]))
    out = Path(a.out)
    (out / ("geglu_mm_ab%s.json" % a.tag)).write_text(json.dumps(rows_out, indent=1))
    (out / ("geglu_mm_ab%s.md" % a.tag)).write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()

"""The encoder's four GEMMs: cuBLAS against Inductor's Triton templates, with and without persistent TMA (Hopper).

Why: in session 37's first `aoti_variants.py` call, `table+autotune+tma` (max-autotune at the 8 x 1024 example,
Inductor's persistent TMA templates allowed) picked TMA kernels for the head's GEMMs that timed 3-16% under the plain
templates' picks, but three packages were compiling and tuning on one GPU at once, and one of them hit a
device-side assert at run time. This times the GEMMs alone, one compile at a time, to say whether a TMA package is worth a full build.

Each GEMM is `F.linear(x, w)` in bf16 (x: tokens x K, w: N x K, no bias, as the encoder's Wqkv, Wo, Wi and the
MLP's Wo for large-1024), compiled with `mode="max-autotune-no-cudagraphs"`, `dynamic=False`, and
`max_autotune_gemm_backends="TRITON"` so a Triton kernel is what runs (cuBLAS would otherwise be picked where it
wins), timed by `triton.testing.do_bench_cudagraph` against `F.linear` itself (cuBLAS).

    python3 benchmarks/investigations/gemm_tma_ab.py --out $OUT --tag _s37
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = ((3072, 1024), (1024, 1024), (5248, 1024), (1024, 2624))  # (N, K): Wqkv, Wo, Wi, the MLP's Wo


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def timed(fn, x, w) -> float:
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(lambda: fn(x, w), rep=50))


def compiled(tma: bool):
    import torch._dynamo
    import torch._inductor.config as ic

    torch._dynamo.reset()
    ic.max_autotune_gemm_backends = "TRITON"
    ic.triton.enable_persistent_tma_matmul = tma
    return torch.compile(linear, mode="max-autotune-no-cudagraphs", dynamic=False)


def _cell(row: dict, name: str) -> str:
    return "-" if not row.get(name) else "%s (%s)" % (row[name], row[name.replace("_ms", "_tflops")])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tag", default="")
    ap.add_argument("--tokens", default="128,4096,16384")
    ap.add_argument("--budget-s", type=float, default=330, help="start no new compile after this many seconds")
    a = ap.parse_args()
    t_start = time.monotonic()
    out = Path(a.out)
    res = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "rows": []}
    for m in [int(t) for t in a.tokens.split(",")]:
        for n, k in SHAPES:
            g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5
            row = {"tokens": m, "n": n, "k": k, "cublas_ms": round(timed(linear, x, w), 5)}
            ref = linear(x, w).float()
            for name, tma in (("triton_ms", False), ("triton_tma_ms", True)):
                if time.monotonic() - t_start > a.budget_s:
                    row[name] = None
                    continue
                fn = compiled(tma)
                y = fn(x, w)
                row[name] = round(timed(fn, x, w), 5)
                row[name.replace("_ms", "_max_abs_diff")] = float((y.float() - ref).abs().max())
            flops = 2 * m * n * k
            for name in ("cublas_ms", "triton_ms", "triton_tma_ms"):
                if row.get(name):
                    row[name.replace("_ms", "_tflops")] = round(flops / row[name] / 1e9, 1)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            (out / ("gemm_tma_ab%s.json" % a.tag)).write_text(json.dumps(res, indent=1))
    lines = ["# The encoder's GEMMs: cuBLAS against Inductor's Triton templates (%s, torch %s)"
             % (res["gpu"], res["torch"]), "", "Command: `%s`" % res["command"], "",
             "| tokens | N x K | cuBLAS ms (TFLOP/s) | Triton ms (TFLOP/s) | Triton TMA ms (TFLOP/s) |",
             "|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append("| %d | %d x %d | %s | %s | %s |" % (r["tokens"], r["n"], r["k"], _cell(r, "cublas_ms"),
                                                        _cell(r, "triton_ms"), _cell(r, "triton_tma_ms")))
    (out / ("gemm_tma_ab%s.md" % a.tag)).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

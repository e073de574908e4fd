"""Can a hand-written Hopper GEMM with the GeGLU in its epilogue beat cuBLAS plus Inductor's pointwise kernel?

Why: session 38 found that Inductor never folds the GeGLU into a GEMM where the time is, and put the ceiling of
doing so at the GeGLU kernel's own time (~62 µs of ~347 per 16-row chunk and layer on the H200, ~3.5 ms of a
32 x 1024 forward). Session 21's hand-written Triton kernel (pointer loads, two accumulators) lost by
1.13x at 16,384 rows. This one is built like Triton's persistent TMA matmul: tensor-descriptor (TMA) loads, one
program per SM walking the tiles in grouped order, two accumulators of BLOCK_M x BLOCK_N (Wi's `a` and `g` rows
for the same output columns), and the epilogue rounding both to bf16 first (as cuBLAS's bf16 product is rounded
today) before `gelu(a) * g` in fp32 and one bf16 store, the order Inductor's pointwise kernel computes it in.

It times, per token count, cuBLAS's Wi GEMM alone (the ceiling), today's block (`F.linear` then Inductor's
kernel, as the package runs it) and this kernel at several tile settings, each replayed from a CUDA graph, and
compares outputs with today's block. Investigation only: nothing in the product uses it.

    python3 benchmarks/investigations/geglu_tma.py --out $OUT --tag _s38
    TRITON_INTERPRET=1 python3 benchmarks/investigations/geglu_tma.py --check   # Triton's interpreter, on a CPU
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from geglu_epilogue_ab import INTER, K, today  # noqa: E402  (the block as the package computes it, a sibling script)
# (BLOCK_M, BLOCK_N per half, BLOCK_K, stages, warps, warp-specialised tile loop[, GROUP_M (8), epilogue in two
# column halves (False)]); set "a" ran first (session 38, H100), set "b" around its best with Triton's warp
# specialisation of the persistent loop, set "c" around b's best
CONFIG_SETS = {
    "a": ((128, 64, 64, 4, 8, False), (128, 128, 64, 3, 8, False), (128, 64, 128, 3, 8, False),
          (128, 128, 64, 4, 8, False), (64, 128, 64, 4, 4, False), (256, 64, 64, 3, 8, False)),
    "b": ((128, 128, 64, 3, 8, False), (128, 128, 64, 3, 8, True), (128, 128, 64, 4, 8, True),
          (128, 128, 64, 2, 8, False), (128, 128, 32, 5, 8, False), (128, 64, 64, 4, 4, True),
          (128, 128, 64, 3, 4, True)),
    "c": ((128, 128, 64, 3, 8, True), (128, 128, 64, 3, 8, True, 16), (128, 128, 64, 3, 8, True, 4),
          (128, 128, 128, 2, 8, True), (128, 128, 64, 3, 8, True, 8, True), (128, 128, 64, 4, 8, True, 8, True),
          (128, 128, 128, 2, 8, True, 8, True)),
}
CONFIGS = CONFIG_SETS["a"]


@triton.jit
def _geglu_kernel(x_desc, w_desc, out_desc, M, N_HALF, KDIM,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  NUM_SMS: tl.constexpr, WS: tl.constexpr, SUBTILE: tl.constexpr):
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N_HALF, BLOCK_N)
    k_tiles = tl.cdiv(KDIM, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    per_group = GROUP_M * num_pid_n
    for tile in tl.range(start, num_tiles, NUM_SMS, flatten=not WS, warp_specialize=WS):
        group = tile // per_group
        first_m = group * GROUP_M
        size_m = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % size_m)
        pid_n = (tile % per_group) // size_m
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            x = x_desc.load([off_m, off_k])
            wa = w_desc.load([off_n, off_k])
            wg = w_desc.load([N_HALF + off_n, off_k])
            acc_a = tl.dot(x, wa.T, acc_a)
            acc_g = tl.dot(x, wg.T, acc_g)
        if SUBTILE:  # two column halves, each stored on its own: fewer live registers in the epilogue
            a0, a1 = tl.split(tl.permute(tl.reshape(acc_a, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            g0, g1 = tl.split(tl.permute(tl.reshape(acc_g, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            out_desc.store([off_m, off_n], _geglu(a0, g0, out_desc.dtype))
            out_desc.store([off_m, off_n + BLOCK_N // 2], _geglu(a1, g1, out_desc.dtype))
        else:
            out_desc.store([off_m, off_n], _geglu(acc_a, acc_g, out_desc.dtype))


@triton.jit
def _geglu(acc_a, acc_g, dtype: tl.constexpr):
    """Both products rounded to the stored dtype first (cuBLAS's output today), then gelu(a) * g in fp32."""
    a = acc_a.to(dtype).to(tl.float32)
    g = acc_g.to(dtype).to(tl.float32)
    return (0.5 * a * (1.0 + tl.erf(a * 0.7071067811865476)) * g).to(dtype)


def geglu_tma(x: torch.Tensor, wi: torch.Tensor, cfg=CONFIGS[0]) -> torch.Tensor:
    """`gelu(a) * g` of `x @ wi.T`'s two column halves, in one kernel; x: M x K, wi: 2I x K, both bf16 or fp16."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, stages, warps, ws, group_m, subtile = (tuple(cfg) + (8, False)[len(cfg) - 6:])[:8]
    m, kdim = x.shape
    n_half = wi.shape[0] // 2
    out = torch.empty((m, n_half), device=x.device, dtype=x.dtype)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    tiles = triton.cdiv(m, bm) * triton.cdiv(n_half, bn)
    # the g half starts at row n_half of wi; a tile of the a half past n_half reads g's first rows, whose columns
    # the store clips (out has n_half columns); past wi's end the loads read zeros
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(wi, [bn, bk])
    out_desc = TensorDescriptor.from_tensor(out, [bm, bn // 2 if subtile else bn])
    grid = (min(sms, tiles),)
    _geglu_kernel[grid](x_desc, w_desc, out_desc, m, n_half, kdim, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                        GROUP_M=group_m, NUM_SMS=grid[0], WS=ws, SUBTILE=subtile, num_stages=stages, num_warps=warps)
    return out


def check() -> None:
    """Small shapes against the reference in fp32, tiles that do and do not divide the sizes (runs under
    TRITON_INTERPRET=1 on a CPU, in fp16: the interpreter's dot does not take bf16)."""
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16
    worst = 0.0
    for m, n_half, kdim, cfg in ((64, 64, 64, (32, 32, 32, 2, 4, False)), (80, 96, 64, (32, 64, 32, 2, 4, False)),
                                 (100, 88, 96, (32, 32, 32, 2, 4, False)),
                                 (100, 88, 96, (32, 32, 32, 2, 4, False, 4, True))):
        x = torch.randn(m, kdim, device=dev).to(dtype)
        wi = (torch.randn(2 * n_half, kdim, device=dev) / kdim ** 0.5).to(dtype)
        y = geglu_tma(x, wi, cfg).float()
        a, g = (x.float() @ wi.float().T).to(dtype).float().chunk(2, dim=-1)
        ref = F.gelu(a) * g
        diff = float((y - ref).abs().max())
        worst = max(worst, diff / float(ref.abs().max()))
        print("check", m, n_half, kdim, cfg, "max |diff|", diff, "of max |ref|", float(ref.abs().max()))
    if worst > 1e-2:
        raise SystemExit("geglu_tma differs from the reference by %.3g of its range" % worst)


def main() -> None:
    from triton.testing import do_bench_cudagraph

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tag", default="")
    ap.add_argument("--tokens", default="16384,4096,512")
    ap.add_argument("--check", action="store_true", help="only the small-shape correctness check")
    ap.add_argument("--set", choices=sorted(CONFIG_SETS), default="a", help="which tile settings to time")
    ap.add_argument("--budget-s", type=float, default=240)
    a = ap.parse_args()
    if a.check:
        check()
        return
    t0 = time.monotonic()
    res = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "rows": []}
    compiled_today = torch.compile(today, dynamic=False)
    for m in [int(t) for t in a.tokens.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16, generator=g)
        wi = torch.randn(2 * INTER, K, device="cuda", dtype=torch.bfloat16, generator=g) / K ** 0.5
        ref = compiled_today(x, wi).float()
        row = {"tokens": m,
               "cublas_mm_ms": round(float(do_bench_cudagraph(lambda x=x, wi=wi: F.linear(x, wi), rep=100)), 5),
               "today_ms": round(float(do_bench_cudagraph(lambda x=x, wi=wi: compiled_today(x, wi), rep=100)), 5),
               "configs": {}}
        for cfg in CONFIG_SETS[a.set]:
            if time.monotonic() - t0 > a.budget_s:
                break
            name = "%dx%dx%d s%d w%d" % cfg[:5] + (" ws" if cfg[5] else "") + "".join(
                (" g%d" % cfg[6]) if len(cfg) > 6 else "") + (" sub" if len(cfg) > 7 and cfg[7] else "")
            try:
                y = geglu_tma(x, wi, cfg)
                ms = float(do_bench_cudagraph(lambda x=x, wi=wi, cfg=cfg: geglu_tma(x, wi, cfg), rep=100))
                row["configs"][name] = {"ms": round(ms, 5), "max_abs_diff": float((y.float() - ref).abs().max())}
            except Exception as e:  # noqa: BLE001 - a tile setting that does not compile or fit is recorded
                row["configs"][name] = {"error": "%s: %s" % (type(e).__name__, str(e)[:300])}
            print(json.dumps({"tokens": m, name: row["configs"][name]}), flush=True)
        timed = {k: v["ms"] for k, v in row["configs"].items() if "ms" in v}
        if timed:
            best = min(timed, key=timed.get)
            row["best"], row["best_ms"] = best, timed[best]
            row["best_over_today"] = round(timed[best] / row["today_ms"], 3)
        res["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "configs"}), flush=True)
        (Path(a.out) / ("geglu_tma%s.json" % a.tag)).write_text(json.dumps(res, indent=1))
    lines = ["# One Hopper kernel for Wi and the GeGLU (%s, torch %s, Triton %s)"
             % (res["gpu"], res["torch"], res["triton"]), "", "Command: `%s`" % res["command"], "",
             "| tokens | cuBLAS Wi alone ms | today ms (cuBLAS + Inductor's kernel) | best fused ms (tiles) | "
             "best / today | max abs diff vs today |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        best = r["configs"].get(r.get("best"), {})
        lines.append("| %d | %s | %s | %s (%s) | %s | %s |" % (r["tokens"], r["cublas_mm_ms"], r["today_ms"],
                                                             r.get("best_ms"), r.get("best"),
                                                             r.get("best_over_today"), best.get("max_abs_diff")))
    (Path(a.out) / ("geglu_tma%s.md" % a.tag)).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

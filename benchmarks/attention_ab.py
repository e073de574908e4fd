"""The exported encoder's attention, A/B on a GPU: transformers' SDPA with its masks (a bundle built with
`export.attention=stock`) against `laya_aot.modeling.attention`'s Triton window kernel (exported and packaged here).

    python3 benchmarks/attention_ab.py --kernel-only --kernel-shapes 1x128,8x256,32x1024 [--graph]
    python3 benchmarks/attention_ab.py --ckpt CKPT --bundle STOCK_BUNDLE

First times the kernel alone against SDPA with the dense masks transformers builds, for a few tile configurations
(`CONFIGS`), at `--kernel-shapes` rows x tokens (default 32 x 1024) x 16 heads x 64 in bf16 with padding, local
(w=64) and global: the GPU's time per call from CUDA events (`gpu_ms`), or with `--graph` replayed from a CUDA
graph (`graph_ms`: what times a short shape's kernel, whose Python launch outlasts it).
Then exports laya's model with `export.attention=triton` as the build does (bf16 under autocast, the same ranges),
packages it with AOTInductor (weights from the checkpoint at load, CUDA graphs on), and loads the bundle's
stock AOTInductor artifact the same way. Both are compared with laya's eager fp32 forward on seeded batches
with padding (max |logit difference| and decisions equal), then timed at the forward-only shapes (median of 20
after 3 warm-ups, synchronised). Not a build: the build's own verification is what ships an artifact.
Writes attention_ab<tag>.json and .md to --out.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import harness
import torch
from harness import FORWARD_SHAPES as SHAPES

CHECKS = ((1, 80), (5, 272), (8, 640), (16, 1024))


def batch(rows: int, length: int, seed: int, vocab: int, pad_id: int, device: str) -> tuple:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, min(vocab, 4000), (rows, length), generator=g)
    att = torch.ones(rows, length, dtype=torch.long)
    for r in range(1, rows):  # rows padded by different amounts, as a realistic batch is
        att[r, int(torch.randint(length // 4, length, (1,), generator=g)):] = 0
    ids[att == 0] = pad_id
    mpos = torch.stack([torch.randperm(int(att[r].sum()), generator=g)[:4] for r in range(rows)])
    return tuple(t.to(device) for t in (ids, att, mpos, torch.ones(rows, 4, dtype=torch.bool),
                                        torch.arange(rows) % 3))


def timed(fn, args) -> float:
    return harness.median_ms(lambda: fn(*args), device="cuda")


def main() -> None:
    import laya
    from safetensors import safe_open

    from laya_aot import checkpoint as ck
    from laya_aot import laya_internals as laya_api
    from laya_aot.kinds import aoti
    from laya_aot.kinds.exported_program import export_model
    from laya_aot.modeling.model import ExplicitDtypeModel

    ap = harness.parser(__doc__, work=True)
    ap.add_argument("--ckpt", help="the checkpoint (not needed with --kernel-only)")
    ap.add_argument("--bundle", help="a bundle of it built with export.attention=stock (not with --kernel-only)")
    ap.add_argument("--max-tokens", type=int, default=1024, help="the export's token range, as the build's")
    ap.add_argument("--kernel-only", action="store_true", help="only the kernel against SDPA, no export")
    ap.add_argument("--kernel-shapes", default="32x1024", help="rows x tokens the kernel alone is timed at, "
                    "comma-separated (16 heads of 64, ModernBERT-large's)")
    ap.add_argument("--graph", action="store_true",
                    help="time the kernel alone replayed from a CUDA graph (what times a short shape)")
    a = ap.parse_args()
    if not a.kernel_only and not (a.ckpt and a.bundle):
        ap.error("--ckpt and --bundle are needed unless --kernel-only")
    res: dict = {"environment": harness.environment()}
    res["kernel"] = [kernel_bench(rows=int(r), length=int(L), graphed=a.graph) for r, L in
                     (shape.split("x") for shape in a.kernel_shapes.split(","))]
    if a.kernel_only:
        write(a, res)
        return
    agent = laya.load(a.ckpt, device="cuda")
    model = agent.model.eval()
    pad_id, vocab = laya_api.pad_id(agent), model.encoder.config.vocab_size
    t = time.perf_counter()
    module = ExplicitDtypeModel(model, torch.bfloat16, torch.float32, "cuda", attention="triton")
    res["attention"] = module.attention
    program = export_model(module, 64, a.max_tokens, 64, pad_id, "cuda")
    res["export_s"] = round(time.perf_counter() - t, 1)
    with safe_open(str(Path(a.ckpt) / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    t = time.perf_counter()
    flash_dir = a.work / "aoti-triton"
    res["package"] = aoti.package(program, flash_dir, keys)
    res["package_s"] = round(time.perf_counter() - t, 1)
    print("packaged", res, flush=True)
    manifest = json.loads((Path(a.bundle) / "bundle.json").read_text())
    stock_dir = Path(a.bundle) / next(x["path"] for x in manifest["artifacts"] if x["kind"] == "aoti")
    runners = {"stock": aoti.AOTIRunner(stock_dir, ck.Weights(a.ckpt), "cuda", cuda_graphs=True),
               "triton": aoti.AOTIRunner(flash_dir, ck.Weights(a.ckpt), "cuda", cuda_graphs=True)}
    res["checks"] = {}
    for rows, length in CHECKS:
        args = batch(rows, length, rows * 7 + length, vocab, pad_id, "cuda")
        with torch.no_grad():
            ref = model(*args)
            row = {}
            for name, run in runners.items():
                got = run(*args)
                d = max(float((x.float() - y.float()).abs().max()) for x, y in zip(ref, got))
                same = int((ref[0].argmax(-1) == got[0].argmax(-1)).sum())
                row[name] = {"max_abs_logit_diff": round(d, 5), "argmax_equal": "%d/%d" % (same, ref[0].shape[0])}
        res["checks"]["%dx%d" % (rows, length)] = row
        print("check", rows, length, row, flush=True)
    res["forward_ms"] = {}
    with torch.no_grad():
        for rows, length in SHAPES:
            args = batch(rows, length, 0, vocab, pad_id, "cuda")
            res["forward_ms"]["%dx%dx4" % (rows, length)] = {n: timed(r, args) for n, r in runners.items()}
            print("forward", rows, length, res["forward_ms"]["%dx%dx4" % (rows, length)], flush=True)
    write(a, res)


def write(a, res: dict) -> None:
    lines = ["Kernel alone, GPU ms per call:", "", "| shape | layer | SDPA, dense mask | shipped tiles | best tiles |",
             "|---|---|---|---|---|"]
    for k in res["kernel"]:
        for window in ("window64", "window-1"):
            row = k[window]
            tiles = {n: v["ms"] for n, v in row.items() if isinstance(v, dict) and "ms" in v}
            best = min(tiles, key=tiles.get) if tiles else None
            shipped = "BM%(BLOCK_M)d_BN%(BLOCK_N)d_w%(num_warps)d_s%(num_stages)d" % row["shipped"] \
                if isinstance(row.get("shipped"), dict) else str(row.get("shipped"))
            lines.append("| %s | %s | %s | %s %s | %s %s |" % (
                k["shape"], "local (w=64)" if window == "window64" else "global", row["sdpa_dense_mask_ms"], shipped,
                tiles.get(shipped, "-"), best, tiles.get(best, "-")))
    for shape, by_runner in (res.get("forward_ms") or {}).items():
        lines.append("\nForward only %s: %s" % (shape, json.dumps(by_runner)))
    harness.write(a.out, "attention_ab" + a.tag, res, "\n".join(lines), title="Attention kernel A/B")


CONFIGS = [dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
           dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
           dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
           dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
           dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=4),
           # smaller query tiles: more programs for a short call (1 x 16 heads x 128 tokens is 16-32 programs with
           # the tiles above, on a GPU of 132 SMs)
           dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3),
           dict(BLOCK_M=16, BLOCK_N=64, num_warps=2, num_stages=3)]


def gpu_ms(fn) -> float:
    """The time between CUDA events around one call (median). At a short call's shapes this is the Python launch,
    not the kernel: a Triton launch from Python outlasts a kernel of a few microseconds and the GPU idles between
    the events; only large shapes are timed truly this way (`graph_ms` times the short ones)."""
    import triton

    return round(float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")), 4)


def graph_ms(fn, calls: int = 20) -> float:
    """GPU time per call of `fn` replayed from one CUDA graph of `calls` launches (median): no Python launch between
    the events, as in a served call replayed from the artifact's CUDA graph; what times a short shape's kernel."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return round(gpu_ms(graph.replay) / calls, 4)


def kernel_bench(rows: int = 32, heads: int = 16, length: int = 1024, dim: int = 64, graphed: bool = False) -> dict:
    """The kernel alone per tile configuration (`window_attention._launch` with each; `blocks` picks the shipped
    one), and SDPA with transformers-style dense boolean masks; GPU time per call (`gpu_ms`, or `graph_ms` when
    `graphed`)."""
    import torch.nn.functional as F

    from laya_aot.modeling import attention
    from laya_aot.modeling import window_attention as wa

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(rows, heads, length, dim, device="cuda", generator=g, dtype=torch.bfloat16)
               for _ in range(3))
    keep = torch.ones(rows, length, dtype=torch.bool, device="cuda")
    for r in range(1, rows):
        keep[r, length - 16 * (r * 7 % max(1, length // 32)):] = False
    out: dict = {"shape": "%dx%dx%dx%d" % (rows, heads, length, dim), "timed": "graph" if graphed else "events"}
    bench = graph_ms if graphed else gpu_ms
    i = torch.arange(length, device="cuda")
    for window in (64, -1):
        allowed = keep[:, None, None, :].expand(rows, 1, length, length)
        if window >= 0:
            allowed = allowed & ((i[:, None] - i[None, :]).abs() <= window)
        flops = 4.0 * float(allowed.sum()) * heads * dim
        few = min(rows, 4)
        ref = attention.reference(q[:few], k[:few], v[:few], keep[:few], None if window < 0 else window,
                                  dim ** -0.5).float()
        row: dict = {"shipped": wa.blocks(dim, window),
                     "sdpa_dense_mask_ms": bench(lambda m=allowed: F.scaled_dot_product_attention(q, k, v,
                                                                                                  attn_mask=m))}
        for c in CONFIGS:
            name = "BM%d_BN%d_w%d_s%d" % (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"])
            try:
                ms = bench(lambda c=c, window=window: wa._launch(q, k, v, keep, window, dim ** -0.5, cfg=c))
                o = wa._launch(q, k, v, keep, window, dim ** -0.5, cfg=c)
                err = float((o[:few].float() - ref).abs().max())
                row[name] = {"ms": ms, "tflops_useful": round(flops / ms / 1e9, 1), "max_err": round(err, 5)}
            except Exception as e:  # noqa: BLE001 - a configuration this GPU cannot run
                row[name] = {"error": "%s: %s" % (type(e).__name__, str(e)[:200])}
        out["window%d" % window] = row
        print("kernel", rows, length, window, row, flush=True)
    return out


if __name__ == "__main__":
    main()

"""The forward's measured floor on this GPU: the kernels every forward of the checkpoint built on cuBLAS runs.

The forward-only targets (1.0 / 3.0 / 24 / 50 ms at 1x128 / 8x256 / 32x512 / 32x1024, x4 markers, and 1.5x of a
limit taken at a nominal 790 TFLOP/s) are figures from the GPU's data sheet, not from its libraries. This script
measures, on the GPU it runs on, a *skeleton* of the encoder: per layer the four linears with cuBLAS (`F.linear`,
bf16, each layer its own weights, so that they come from memory as the model's do), attention with torch's own SDPA
(flash or cuDNN; a local layer as 64-query blocks over the 192 keys its window reaches) or the package's own
attention kernel, whichever is fastest here for each kind of layer, and the two layer norms as one kernel each.
No rotary, GeGLU, residual add, embedding or decision head; the GeGLU's second GEMM reads a column view of the
first's output, so no copy either. All layers are captured in one CUDA graph and replayed (the gaps between
kernels are real ones). Any forward built from cuBLAS GEMMs, attention no faster than these kernels and one kernel
per norm, however fused otherwise, takes at least this long; today's default package (`--package`, the bundle's
`aoti-sm_90` folder) is timed in the same process, as served (CUDA graphs on), for the ratio.
Outputs of the skeleton mean nothing.

    python3 benchmarks/forward_floor.py --ckpt CKPT --package BUNDLE/aoti-sm_90

Writes forward_floor<tag>.json and .md to --out.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import harness
import torch
import torch.nn.functional as F
from harness import FORWARD_SHAPES as SHAPES

TARGETS_MS = {(1, 128): 1.0, (8, 256): 3.0, (32, 512): 24.0, (32, 1024): 50.0}  # the forward-only targets
NOMINAL_TFLOPS = 790.0  # the H200's data-sheet dense 16-bit rate
LOCAL_BLOCK = 64  # queries per block of a local layer (the shipped kernel's BLOCK_M for a window)


def dims(ckpt: Path) -> dict:
    """The encoder's sizes from the checkpoint: linear shapes from layer 0's weights, the rest from its config."""
    from safetensors import safe_open

    cfg = json.loads((ckpt / "encoder" / "config.json").read_text())
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        shape = {k: f.get_slice(k).get_shape() for k in f.keys()}
    params = sum(int(torch.Size(s).numel()) for s in shape.values())
    lin = {n: shape["encoder.layers.0.%s.weight" % n] for n in ("attn.Wqkv", "attn.Wo", "mlp.Wi", "mlp.Wo")}
    return {"hidden": lin["attn.Wqkv"][1], "heads": int(cfg["num_attention_heads"]),
            "layers": int(cfg["num_hidden_layers"]), "window": int(cfg.get("local_attention", 128)),
            "global_every": int(cfg.get("global_attn_every_n_layers", 3)), "linears": lin, "params": params}


def graph_ms(step, repeats: int = 20) -> float:
    """Median ms of one replay of a CUDA graph of `step` (captured after one eager warm-up)."""
    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del g
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes per ms a plain device-to-device copy of 1 GiB moves here (read plus write): the memory floor's rate."""
    src = torch.empty(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = graph_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms


def fastest(candidates: dict) -> tuple:
    """(name, ms, call) of the fastest of `candidates` (name -> call), each timed in a graph of its own."""
    best = None
    for name, call in candidates.items():
        try:
            ms = graph_ms(call)
        except RuntimeError as e:  # a backend that does not take these inputs on this GPU
            print("attention %s: %s" % (name, str(e).splitlines()[0][:200]), flush=True)
            continue
        if best is None or ms < best[1]:
            best = (name, ms, call)
    if best is None:
        raise SystemExit("no attention kernel ran here: %s" % ", ".join(candidates))
    return best


def sdpa(backend: str, q, k, v):
    """SDPA on one backend, as a call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def call():
        with sdpa_kernel([chosen]):
            return F.scaled_dot_product_attention(q, k, v)

    return call


def shipped(q, k, v, window: int):
    """The package's own attention kernel (`modeling.window_attention`, every key a token), as a call; None where
    it cannot be imported."""
    try:
        from laya_aot.modeling import window_attention  # noqa: F401 - registers the op
    except ImportError:
        return None
    keep = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device)
    return lambda: torch.ops.laya_aot.window_attention(q, k, v, keep, window, q.shape[-1] ** -0.5)


def skeleton(d: dict, rows: int, length: int, bandwidth: float) -> dict:
    """The skeleton's parts and whole at one shape, ms (see the module docstring). Each kind of layer's attention
    is the fastest here of SDPA's flash and cuDNN backends (a local layer as 64-query blocks over the keys its
    window reaches) and the package's own kernel (a local layer on the whole rows, visiting only those blocks).
    `ideal_local_ms` is computed, not measured: the skeleton with each local layer's attention at its own floor,
    the larger of the global kernel's time scaled by the keys a query block reaches and q, k, v and the output
    moved once at `bandwidth`."""
    dev, dt = "cuda", torch.bfloat16
    t = rows * length
    h, heads = d["hidden"], d["heads"]
    hd = h // heads
    ws = [{n: torch.randn(s, device=dev, dtype=dt) * 0.02 for n, s in d["linears"].items()}
          for _ in range(d["layers"])]
    two_i, inter = d["linears"]["mlp.Wi"][0], d["linears"]["mlp.Wo"][1]
    x = torch.randn(t, h, device=dev, dtype=dt)
    up = torch.randn(t, two_i, device=dev, dtype=dt)
    gated = up[:, :inter]  # a column view: cuBLAS reads it with its row stride, no copy
    norm_w = torch.ones(h, device=dev, dtype=dt)
    q, k, v = (torch.randn(rows, heads, length, hd, device=dev, dtype=dt) for _ in range(3))
    half = d["window"] // 2  # ModernBERT's local layers: query i attends key j iff |i - j| <= window / 2
    keys = min(length, LOCAL_BLOCK * (1 + 2 * -(-half // LOCAL_BLOCK)))  # the key blocks a query block reaches
    local_is_global = keys >= length
    glob = {"flash": sdpa("flash", q, k, v), "cudnn": sdpa("cudnn", q, k, v), "shipped": shipped(q, k, v, -1)}
    g_name, g_ms, g_call = fastest({n: c for n, c in glob.items() if c is not None})
    if local_is_global:
        l_name, l_ms, l_call = g_name, g_ms, g_call
    else:
        blocks = rows * (length // LOCAL_BLOCK)
        lq = torch.randn(blocks, heads, LOCAL_BLOCK, hd, device=dev, dtype=dt)
        lk, lv = (torch.randn(blocks, heads, keys, hd, device=dev, dtype=dt) for _ in range(2))
        local = {"flash": sdpa("flash", lq, lk, lv), "cudnn": sdpa("cudnn", lq, lk, lv),
                 "shipped": shipped(q, k, v, half)}
        l_name, l_ms, l_call = fastest({n: c for n, c in local.items() if c is not None})
    n_global = len([i for i in range(d["layers"]) if i % d["global_every"] == 0])
    n_local = d["layers"] - n_global
    out: dict = {"tokens": t, "global_attention": [g_name, round(g_ms, 4)],
                 "local_attention": [l_name, round(l_ms, 4), "keys per query block %d" % keys]}

    def gemms():
        for w in ws:
            F.linear(x, w["attn.Wqkv"])
            F.linear(x, w["attn.Wo"])
            F.linear(x, w["mlp.Wi"])
            F.linear(gated, w["mlp.Wo"])

    def layer_stack():
        for i, w in enumerate(ws):
            F.linear(x, w["attn.Wqkv"])
            (g_call if i % d["global_every"] == 0 else l_call)()
            F.linear(x, w["attn.Wo"])
            F.layer_norm(x, (h,), norm_w)
            F.linear(x, w["mlp.Wi"])
            F.linear(gated, w["mlp.Wo"])
            F.layer_norm(x, (h,), norm_w)

    out["gemms_ms"] = round(graph_ms(gemms), 4)
    out["attention_ms"] = round(n_global * g_ms + n_local * l_ms, 4)
    out["skeleton_ms"] = round(graph_ms(layer_stack), 4)
    local_floor = min(l_ms, max(g_ms * keys / length, 4 * q.numel() * q.element_size() / bandwidth))
    out["local_floor_ms"] = round(local_floor, 4)
    out["ideal_local_ms"] = round(out["skeleton_ms"] - n_local * (l_ms - local_floor), 4)
    gemm_flop = 2 * t * sum(a * b for a, b in d["linears"].values()) * d["layers"]
    out["gemm_tflops"] = round(gemm_flop / out["gemms_ms"] / 1e9, 1)
    return out


def package_ms(ckpt: Path, package: Path, shapes) -> dict:
    """Today's package, forward only, as served (CUDA graphs on): median ms of 20 after 3 warm-ups, synchronised."""
    from safetensors.torch import load_file

    from laya_aot.kinds.aoti import AOTIRunner

    tensors = load_file(str(ckpt / "model.safetensors"))
    vocab = harness.vocab_of(tensors)
    runner = AOTIRunner(package, tensors, "cuda", cuda_graphs=True)
    res = {}
    for rows, length in shapes:
        args = harness.forward_args(rows, length, vocab, "cuda", seed=rows * 10000 + length)
        res["%dx%d" % (rows, length)] = harness.median_ms(lambda args=args: runner(*args), device="cuda")
    runner = None  # the package's memory goes before the skeleton's timings
    torch.cuda.empty_cache()
    return res


def markdown(res: dict) -> str:
    lines = ["| shape (x4 markers) | tokens | cuBLAS GEMMs alone (TFLOP/s) | attention alone (backends) | skeleton "
             "| skeleton, local layers at their floor | today's package | package / skeleton | forward-only target "
             "| target / skeleton | nominal limit |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, s in res["shapes"].items():
        pkg = res.get("package_ms", {}).get(shape)
        tgt = s["target_ms"]
        lines.append("| %s | %d | %.3f (%.0f) | %.3f (%s / %s) | **%.3f** | %.3f | %s | %s | %.1f | %.2f | %.3f |" % (
            shape, s["tokens"], s["gemms_ms"], s["gemm_tflops"], s["attention_ms"], s["global_attention"][0],
            s["local_attention"][0], s["skeleton_ms"], s["ideal_local_ms"], "-" if pkg is None else "%.3f" % pkg,
            "-" if pkg is None else "%.2f" % (pkg / s["skeleton_ms"]), tgt, tgt / s["skeleton_ms"],
            s["nominal_limit_ms"]))
    lines += ["", "ms; the skeleton is every layer's four cuBLAS linears, its SDPA and two layer norms, replayed "
              "from one CUDA graph (median of 20). Attention alone: per kind of layer the fastest of SDPA's flash "
              "and cuDNN backends (global layers dense, local layers as %d-query blocks over the keys their window "
              "reaches) and the package's own kernel, each timed alone. The local layers' floor (computed, not "
              "measured): the larger of the global kernel's time scaled by the keys reached and q, k, v and the "
              "output moved once at the measured copy rate (%.2f TB/s). The nominal limit: "
              "2 x %.0fM parameters x tokens at %.0f TFLOP/s." % (LOCAL_BLOCK, res["bandwidth_bytes_per_ms"] / 1e9,
                                                                  res["dims"]["params"] / 1e6, NOMINAL_TFLOPS)]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--package", help="a bundle's aoti-sm_90 folder, timed in the same process")
    ap.add_argument("--shapes", default=",".join("%dx%d" % s for s in SHAPES))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("forward_floor.py times CUDA kernels: run it on a GPU machine")
    ckpt = Path(a.ckpt)
    shapes = harness.shapes_arg(a.shapes)
    d = dims(ckpt)
    res: dict = {"environment": harness.environment(), "dims": d, "shapes": {}}
    if a.package:
        res["package_ms"] = package_ms(ckpt, Path(a.package), shapes)
        print("package", res["package_ms"], flush=True)
    res["bandwidth_bytes_per_ms"] = round(copy_bandwidth())
    for rows, length in shapes:
        s = skeleton(d, rows, length, res["bandwidth_bytes_per_ms"])
        s["target_ms"] = TARGETS_MS.get((rows, length))
        s["nominal_limit_ms"] = round(2 * d["params"] * rows * length / (NOMINAL_TFLOPS * 1e12) * 1e3, 4)
        res["shapes"]["%dx%d" % (rows, length)] = s
        print("%dx%d" % (rows, length), s, flush=True)
        torch.cuda.empty_cache()
    harness.write(a.out, "forward_floor" + a.tag, res, markdown(res), title="The forward's measured floor")


if __name__ == "__main__":
    main()

"""The encoder's GeGLU as a GEMM epilogue: does Inductor fuse `gelu(a) * g` into a GEMM template, and is it faster?

Why: session 22's kernel list (session 37's analysis) puts the GeGLU's own kernel at ~4.3 ms of a 32 x 1024 forward (the 2I-wide product
of Wi written by cuBLAS, then read back), and `aoti_variants.py +splitmlp+autotune+tma` (the whole model with the
GeGLU's halves as two GEMMs, tuned) could not be compiled inside one device call (session 38: killed at 400 s,
still tuning). This times the one block the split is for, alone, so the question costs minutes:

- `today`: `gelu(chunk(F.linear(x, Wi))) * g` compiled without max-autotune (cuBLAS, then one Triton pointwise
  kernel), as the package computes it;
- `split`: `gelu(F.linear(x, Wa)) * F.linear(x, Wg)` (Wa, Wg: Wi's two halves) with max-autotune, Triton
  templates (with persistent TMA) and cuBLAS both allowed: what a tuned `+splitmlp` build would pick;
- `split_triton`: the same with Triton templates only, so the fused template is timed even where it loses.

bf16, no bias (ModernBERT's `mlp_bias=False`), exact gelu, large-1024's sizes (K 1024, I 2624), each replayed
from a CUDA graph (`do_bench_cudagraph`). `<variant>_kernels` lists the GEMM kernels in each compiled graph's code
(Inductor's templates and cuBLAS calls): a `triton_tem_fused_..._mul...` name is a GEMM that computes the GeGLU in
its epilogue.

`--block residual` asks the same of the residual add that follows the MLP's Wo (K 2624, N 1024): `today` is
`res + F.linear(h, Wo)` in fp32 and the next layer norm (Inductor fuses the add into the norm's kernel; cuBLAS's
bf16 product is written and read back), `split`/`split_triton` the same function with max-autotune, where a
template can take the add as its epilogue (`triton_tem_fused_..._add...`).

    python3 benchmarks/investigations/geglu_epilogue_ab.py --out $OUT --tag _s38
    python3 benchmarks/investigations/geglu_epilogue_ab.py --block residual --out $OUT --tag _s38
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

K, INTER = 1024, 2624


def today(x: torch.Tensor, wi: torch.Tensor) -> torch.Tensor:
    a, g = F.linear(x, wi).chunk(2, dim=-1)
    return F.gelu(a) * g


def split(x: torch.Tensor, wa: torch.Tensor, wg: torch.Tensor) -> torch.Tensor:
    return F.gelu(F.linear(x, wa)) * F.linear(x, wg)


def residual(h: torch.Tensor, wo: torch.Tensor, res: torch.Tensor, lw: torch.Tensor):
    r = res + F.linear(h, wo).float()
    return r, F.layer_norm(r, (K,), lw).to(torch.bfloat16)


def compiled(fn, autotune: bool, backends: str):
    import torch._dynamo
    import torch._inductor.config as ic

    torch._dynamo.reset()
    ic.max_autotune_gemm_backends = backends
    ic.triton.enable_persistent_tma_matmul = autotune
    mode = "max-autotune-no-cudagraphs" if autotune else "default"
    return torch.compile(fn, mode=mode, dynamic=False)


def run(fn, args) -> tuple[torch.Tensor, float, list]:
    from torch._inductor.utils import run_and_get_code
    from triton.testing import do_bench_cudagraph

    y, codes = run_and_get_code(fn, *args)
    text = "\n".join(codes)
    templates = sorted(set(re.findall(r"triton_tem_fused_\w+", text)))
    externs = sorted(set(re.findall(r"extern_kernels\.\w+", text)))
    return y, float(do_bench_cudagraph(lambda: fn(*args), rep=100)), templates + externs


def main() -> None:
    import torch._inductor.config as ic

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tag", default="")
    ap.add_argument("--tokens", default="16384,4096,512")
    ap.add_argument("--block", choices=("geglu", "residual"), default="geglu")
    ap.add_argument("--budget-s", type=float, default=300, help="start no new compile after this many seconds")
    a = ap.parse_args()
    t_start = time.monotonic()
    out = Path(a.out)
    res = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "benchmark_epilogue_fusion": getattr(ic, "benchmark_epilogue_fusion", None), "rows": []}
    for m in [int(t) for t in a.tokens.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16, generator=g)
        wi = torch.randn(2 * INTER, K, device="cuda", dtype=torch.bfloat16, generator=g) / K ** 0.5
        wa, wg = wi[:INTER].contiguous(), wi[INTER:].contiguous()
        if a.block == "geglu":
            plain, fused, plain_args, fused_args = today, split, (x, wi), (x, wa, wg)
        else:
            h = F.gelu(torch.randn(m, INTER, device="cuda", dtype=torch.bfloat16, generator=g))
            wo = torch.randn(K, INTER, device="cuda", dtype=torch.bfloat16, generator=g) / INTER ** 0.5
            resid = torch.randn(m, K, device="cuda", generator=g)
            lw = 1 + 0.1 * torch.randn(K, device="cuda", generator=g)
            plain, fused, plain_args = residual, residual, (h, wo, resid, lw)
            fused_args = plain_args
        row = {"tokens": m}
        ref = None
        for name, fn, args, autotune, backends in (
                ("today", plain, plain_args, False, "ATEN"),
                ("split", fused, fused_args, True, "TRITON,ATEN"),
                ("split_triton", fused, fused_args, True, "TRITON")):
            if time.monotonic() - t_start > a.budget_s:
                row[name + "_ms"] = None
                continue
            y, ms, kernels = run(compiled(fn, autotune, backends), args)
            row[name + "_ms"] = round(ms, 5)
            row[name + "_kernels"] = kernels
            y = y[-1] if isinstance(y, tuple) else y
            if ref is None:
                ref = y.float()
            else:
                row[name + "_max_abs_diff"] = float((y.float() - ref).abs().max())
            print(json.dumps({"tokens": m, name: row[name + "_ms"], "kernels": kernels}), flush=True)
        res["rows"].append(row)
        (out / ("%s_epilogue_ab%s.json" % (a.block, a.tag))).write_text(json.dumps(res, indent=1))
    title = "The GeGLU" if a.block == "geglu" else "The residual add after the MLP's Wo"
    lines = ["# %s as a GEMM epilogue (%s, torch %s)" % (title, res["gpu"], res["torch"]), "",
             "Command: `%s`" % res["command"], "",
             "| tokens | today ms (cuBLAS + Inductor's kernel) | tuned ms (`split`) | tuned, Triton only ms "
             "(`split_triton`) | fused into a template: split / split_triton |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        mark = "mul" if a.block == "geglu" else "add"
        fused = ["yes" if any(mark in k and "tem_fused" in k for k in r.get(n + "_kernels", [])) else "no"
                 for n in ("split", "split_triton")]
        lines.append("| %d | %s | %s | %s | %s |" % (r["tokens"], r.get("today_ms"), r.get("split_ms"),
                                                   r.get("split_triton_ms"), " / ".join(fused)))
    (out / ("%s_epilogue_ab%s.md" % (a.block, a.tag))).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

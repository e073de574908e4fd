"""The head's masked attention compiled by AOTInductor with torch's default kernel choice and with
`laya_aot.modeling.head.attention_backends` (no cuDNN): the first call at each new shape, and the same shapes again.

    python benchmarks/head_attention_shapes.py --device cuda --out $OUT

On an H100 torch picks cuDNN's attention for a masked 16-bit `scaled_dot_product_attention`; cuDNN builds an
execution plan at every new shape. Each variant is exported (rows, queries and keys dynamic, as the artifacts are),
compiled into its own package, loaded, and called at --shapes new shapes (rows, queries, keys drawn once), then at
the same shapes again. Prints and writes the median ms of each pass and the attention kernel the package calls.
"""
from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Tuple

import harness

sys.path.insert(0, str(harness.ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.export import Dim  # noqa: E402

from laya_aot.kinds.aoti import choose_compiler, compiler_patch  # noqa: E402
from laya_aot.modeling.head import attention_backends  # noqa: E402

KERNELS = ("cudnn_attention", "efficient_attention", "flash_attention", "math")


class Attend(torch.nn.Module):
    """What the head's `attention` runs after its projections: SDPA with laya's key-padding mask."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])


def inputs(rows: int, queries: int, keys: int, heads: int, dim: int, dtype: torch.dtype, device: str):
    g = torch.Generator(device="cpu").manual_seed(rows * 7919 + queries * 31 + keys)
    q, k, v = (torch.randn(rows, heads, n, dim, generator=g).to(device, dtype) for n in (queries, keys, keys))
    keep = torch.ones(rows, keys, dtype=torch.bool)
    keep[:, keys - keys // 4:] = False
    return q, k, v, keep.to(device)


def compiled(work: Path, name: str, no_cudnn: bool, a) -> Tuple[Any, List[str]]:
    dtype = getattr(torch, a.dtype)
    rows, queries, keys = Dim("rows", min=1, max=64), Dim("queries", min=2, max=1024), Dim("keys", min=2, max=1024)
    shapes = {"q": {0: rows, 2: queries}, "k": {0: rows, 2: keys}, "v": {0: rows, 2: keys}, "keep": {0: rows, 1: keys}}
    example = inputs(4, 8, 96, a.heads, a.dim, dtype, a.device)
    path = work / (name + ".pt2")
    ctx = attention_backends() if no_cudnn else torch.no_grad()
    with torch.no_grad(), ctx, torch._inductor.config.patch(compiler_patch(choose_compiler())):
        ep = torch.export.export(Attend(), example, dynamic_shapes=shapes, strict=False)
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path))  # as kinds/aoti.py compiles
    with zipfile.ZipFile(path) as z:
        text = " ".join(z.read(n).decode("utf-8", "replace") for n in z.namelist() if n.endswith((".cpp", ".h")))
    return torch._inductor.aoti_load_package(str(path)), [k for k in KERNELS if k in text]


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--shapes", type=int, default=12, help="new shapes timed")
    a = ap.parse_args()
    rng = random.Random(59)
    new = [(rng.randint(1, 32), rng.randint(2, 64), 16 * rng.randint(2, 64)) for _ in range(a.shapes)]
    sync = harness.synchronizer(a.device)
    result: Dict[str, Any] = {"shapes": new, "variants": {}}
    with tempfile.TemporaryDirectory(prefix="head-attention-") as tmp:
        for name, no_cudnn in (("default", False), ("no_cudnn", True)):
            runner, kernels = compiled(Path(tmp), name, no_cudnn, a)
            passes = []
            for _ in range(2):
                ms = []
                for shape in new:
                    args = inputs(*shape, a.heads, a.dim, getattr(torch, a.dtype), a.device)
                    sync()
                    t = time.perf_counter()
                    runner(*args)
                    sync()
                    ms.append((time.perf_counter() - t) * 1e3)
                passes.append(round(statistics.median(ms), 3))
            result["variants"][name] = {"kernels": kernels, "first_call_ms": passes[0], "again_ms": passes[1]}
            print("%-9s kernels %s: median %.3f ms at a new shape, %.3f ms at the same shapes again"
                  % (name, kernels, passes[0], passes[1]), flush=True)
    body = "| variant | attention kernel in the package | new shape, median ms | same shape again, median ms |\n" \
           "|---|---|---|---|\n" + "".join("| %s | %s | %s | %s |\n" % (n, ", ".join(v["kernels"]) or "-",
                                                                          v["first_call_ms"], v["again_ms"])
                                           for n, v in result["variants"].items())
    harness.write(a.out, "head_attention_shapes" + a.tag, result, body, title="Head attention at new shapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The rotary embedding fused into the attention kernel, A/B on a GPU at the kernel level (issue 24).

`export.attention=triton` leaves ModernBERT's rotation to Inductor, which fuses the sin and cos of the positions into
one kernel per layer that writes rotated queries and keys for the attention kernel to read back;
`export.attention=triton_rope` hands the kernel the unrotated views of Wqkv's output and the tables
(`window_attention.window_attention_rope`). Both are compiled here as the export compiles them (torch.compile,
Inductor: the rotary tables computed from the positions as transformers' ModernBertRotaryEmbedding computes them,
inside the compiled function), at ModernBERT-large's attention shape (16 heads of 64) in bf16, local (window 64)
and global, with padding; median of 50 after 3 warm-ups, synchronised (`attention_ab.timed`); outputs
compared. Not a build: only a built and verified artifact says how a whole forward changes.

    python3 benchmarks/rope_ab.py --out $OUT [--tag _run1]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SHAPES = ((16, 1024), (8, 256))  # rows x tokens: one piece of a 32 x 1024 call (the chunk budget), a medium call
HEADS, DIM = 16, 64
THETAS = {"local": (10000.0, 64), "global": (160000.0, -1)}


def tables(length: int, theta: float, device: str) -> tuple:
    """cos, sin (1 x L x D, fp32) as transformers' ModernBertRotaryEmbedding computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, DIM, 2, dtype=torch.int64, device=device).float() / DIM))
    pos = torch.arange(length, device=device)[None]
    freqs = pos[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def unfused(qkv, keep, theta: float, window: int):
    from laya_aot import attention

    length = qkv.shape[1]
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=2))
    cos, sin = tables(length, theta, qkv.device.type)
    q, k = attention.rotate(q, k, cos, sin)
    return torch.ops.laya_aot.window_attention(q, k, v, keep, window, DIM ** -0.5)


def fused(qkv, keep, theta: float, window: int):
    length = qkv.shape[1]
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=2))
    cos, sin = tables(length, theta, qkv.device.type)
    return torch.ops.laya_aot.window_attention_rope(q, k, v, cos, sin, keep, window, DIM ** -0.5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--shapes", default=",".join("%dx%d" % s for s in SHAPES), help="rows x tokens, comma-separated")
    a = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    from attention_ab import timed  # this script's directory: the A/B's one timing loop

    from laya_aot import window_attention  # noqa: F401 - registers both ops

    rows_out = []
    compiled = {name: torch.compile(fn, dynamic=False) for name, fn in (("triton", unfused), ("triton_rope", fused))}
    for rows, length in shapes:
        g = torch.Generator().manual_seed(rows * length)
        qkv = torch.randn(rows, length, 3, HEADS, DIM, generator=g).to("cuda", torch.bfloat16)
        keep = torch.ones(rows, length, dtype=torch.bool)
        for r in range(1, rows):
            keep[r, int(torch.randint(length // 4, length, (1,), generator=g)):] = False
        keep = keep.cuda()
        for kind, (theta, window) in THETAS.items():
            args = (qkv, keep, theta, window)
            with torch.no_grad():
                outs = {name: fn(*args) for name, fn in compiled.items()}
                ms = {name: timed(fn, args, n=50) for name, fn in compiled.items()}
            valid = keep[:, :, None, None]
            diff = float(((outs["triton"].float() - outs["triton_rope"].float()) * valid).abs().max())
            row = {"rows": rows, "tokens": length, "layer": kind, "triton_ms": ms["triton"],
                   "triton_rope_ms": ms["triton_rope"], "ratio": round(ms["triton_rope"] / ms["triton"], 3),
                   "max_abs_diff": diff}
            print(row, flush=True)
            rows_out.append(row)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"command": "benchmarks/rope_ab.py --out %s --tag %s --shapes %s" % (a.out, a.tag, a.shapes),
           "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "rows": rows_out}
    (out / ("rope_ab%s.json" % a.tag)).write_text(json.dumps(res, indent=1))
    lines = ["# Rotary embedding fused into the attention kernel: kernel-level A/B", "",
             "Command: `%s`; %s, torch %s" % (res["command"], res["gpu"], res["torch"]), "",
             "| rows x tokens | layer | triton (rotary by Inductor) ms | triton_rope ms | ratio | max abs diff |",
             "|---|---|---|---|---|---|"]
    lines += ["| %d x %d | %s | %s | %s | %s | %.3g |" % (r["rows"], r["tokens"], r["layer"], r["triton_ms"],
                                                       r["triton_rope_ms"], r["ratio"], r["max_abs_diff"])
              for r in rows_out]
    (out / ("rope_ab%s.md" % a.tag)).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

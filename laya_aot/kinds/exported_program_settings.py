"""The exported_program kind's settings, the build config's `export` section (`export.max_rows=128`).

Kept apart from `exported_program.py` because the build schema (`config.py`) composes it and `laya-aot build`
checks overrides against that schema before torch is imported: this module imports neither torch nor
anything of the package (`tests/project/test_architecture.py` checks it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class ExportConfig:
    """The exported_program kind's settings: dynamic ranges declared to torch.export (tokens are 16 * Dim up
    to `max_tokens`), and the action head's dtype every kind builds with."""

    max_rows: int = 64
    max_markers: int = 64
    # null = the checkpoint's context length (max_len) rounded up to a multiple of 16 (`padding.context_tokens`)
    max_tokens: Optional[int] = None
    # dtype of the confidence features and the action head (explicit, so AOTInductor sees one dtype)
    action_head_dtype: str = "fp32"
    # how a 16-bit artifact computes (laya_aot/modeling/model.py, laya_aot/numerics/precision.py): "faithful" keeps fp32
    # everywhere but the matrix products (residual stream, norms, softmax, activations, the scorer and its logits),
    # whose inputs and
    # weights are 16-bit with fp32 accumulation, in fp16 where the checkpoint's activations measured on the verify
    # suite's cases stay below fp16's largest value / fp16_headroom, else bf16 (the reason in the manifest); "laya"
    # computes as laya serves (autocast in the target dtype: products, their outputs and the logits rounded to it)
    precision: str = "faithful"
    # fp16 matrix products only where the largest activation times this stays below 65504
    fp16_headroom: float = 16.0
    # "triton": on a GPU in 16 bits, ModernBERT's attention with one Triton kernel reading the padding mask and
    # the local window directly, no L x L masks (laya_aot/modeling/attention.py); "stock": transformers' SDPA
    # attention with its masks, as laya runs it. The CPU and fp32 always export stock attention. (The same kernel also
    # rotating queries and keys as it loads them verified but was slower on the H200, 73.6 against 65.0 ms at
    # 32x1024: every query block rotates each key block again; it is not built.)
    attention: str = "triton"
    # "table": the rotary embedding's cos and sin read from a table of the export's positions, made once at export
    # by transformers' own rotary forward (laya_aot/modeling/rotary.py), instead of recomputed inside every layer's
    # kernel; "computed": as transformers computes them on every forward
    rotary: str = "table"
    # "answer_rows": the decision head's last layer computed only where laya's head reads its output (position 0
    # and the markers; laya_aot/modeling/head.py), -11% of a base-512 forward on the CPU at 8x256; "full": over every
    # token, as laya's forward does
    head: str = "answer_rows"
    # "packed": the encoder runs a call's rows back to back, each its own tokens only (laya_aot/modeling/packed.py):
    # no cells for padding. The AOTInductor package takes the collated batch as every artifact does and packs it on
    # the host; "padded": every row at the width of the call's longest, as laya computes it, and faster: packed rows
    # were slower on every call measured on an H100 (benchmarks/results/calls.md)
    rows: str = "padded"
    # the example batch torch.export traces with, rows x tokens; AOTInductor tunes its Triton kernels' launch
    # settings at these sizes. null = by device: on a GPU 8 x 1024 (capped by max_rows and max_tokens), measured on
    # large-1024 against the 3 x 48 used before: -3.7 / -4.5 / -5.1% at 8x256 / 32x512 / 32x1024 and +2.5 / +3.8% at
    # 1x128 / 1x80 (benchmarks/results/calls.md); on the CPU 3 x 48 (its C++ kernels are not
    # tuned at the example)
    example_rows: Optional[int] = None
    example_tokens: Optional[int] = None
    # true: the portable program is also written into the bundle (`exported_program/<dtype>.pt2`, verified like the
    # rest). It holds a copy of every weight (964 of a 969 MB large-1024 sm_90 bundle) and no runtime reads it: the
    # compiled kinds take the program in memory and their constants from the checkpoint, so by default it is not
    # shipped (turn it on to run or inspect the program itself, `torch.export.load`)
    ship_program: bool = False

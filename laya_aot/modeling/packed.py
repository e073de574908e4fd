"""Packed rows: a call's question rows back to back in one row of real tokens, for the encoder.

A padded call computes every row at the width of its longest row (and, for a CUDA graph, at a stepped shape): on
a mixed stream about 13-15% of the encoder's cells are padding (`benchmarks/results/peer.md`). Packed, each row
is a segment of one row of the call's real tokens only: attention stays within a segment (`attention.Segments`,
`window_attention.segment_attention`), and each token keeps its position within its own row (the rotary
positions laya's forward gives it). The encoder is ModernBERT's own forward on that row.

The rest of laya's forward (the question type's embedding, the decision head's layers, the markers, the scorer,
the action head) runs as laya runs it, on the rows laid out padded again: `PackedModel` gathers each row's hidden
states back into the padded layout and calls the export copy's own forward with its encoder's output given. The
head is 2 of ModernBERT-large's 30 layers; laya's code is not written again.

`pack` makes a packed call's inputs from laya's collated (padded) batch on the host.
"""
from __future__ import annotations

import types
from typing import Tuple

import torch

from .attention import Segments
from .model import ExplicitDtypeModel

ROWS = ("padded", "packed")  # export.rows
# where packed rows are built: a GPU's kernel visits only each segment's keys. On the CPU each segment's attention is
# laid out as a padded row again and back, and the tiny demo's packed CPU artifact answered its mixed stream 2.2x
# slower than padded (benchmarks/results/calls.md)
DEVICES = ("cuda",)
INPUT_NAMES = ("input_ids", "segments", "positions", "segment_lo", "segment_hi", "rows_index", "attention_mask",
               "marker_pos", "marker_mask", "qtype")
Batch = Tuple[torch.Tensor, ...]


def pack(batch: Batch, pad_id: int, multiple: int = 16) -> Batch:
    """`batch` (input_ids, attention_mask, marker_pos, marker_mask, qtype: rows padded on the right, as laya
    collates them) as a packed call's inputs (`INPUT_NAMES`): the rows' real tokens back to back in one row of T
    tokens (their sum, rounded up to `multiple`), each numbered by its segment (row r: r + 1; padding: 0), at its
    position within its row, with its segment's first position and the one past its last (padding: T and 0); the
    packed position of every cell of the padded layout (`rows_index`, padding: 0); the rest as given."""
    ids, att, mpos, mmask, qtype = batch
    rows, width = ids.shape
    real = att.bool()
    lens = real.sum(1)
    if not torch.equal(real, torch.arange(width)[None, :] < lens[:, None]):
        raise ValueError("packed rows take rows padded on the right (each row's tokens first), as laya collates them")
    if bool(((mpos >= lens[:, None]) & mmask.bool()).any()):
        raise ValueError("a marker points past its row's tokens: packed rows read markers within their own row only "
                         "(laya's rows always hold their markers)")
    total = int(lens.sum())
    t = max(multiple, -(-total // multiple) * multiple)
    starts = torch.cumsum(lens, 0) - lens
    seg = torch.zeros(1, t, dtype=torch.int32)
    pos = torch.zeros(1, t, dtype=torch.long)
    lo = torch.full((1, t), t, dtype=torch.int32)
    hi = torch.zeros(1, t, dtype=torch.int32)
    packed = torch.full((1, t), pad_id, dtype=ids.dtype)
    packed[0, :total] = ids[real]
    seg[0, :total] = torch.repeat_interleave(torch.arange(1, rows + 1, dtype=torch.int32), lens)
    pos[0, :total] = torch.arange(width).expand(rows, -1)[real]
    lo[0, :total] = torch.repeat_interleave(starts, lens).to(torch.int32)
    hi[0, :total] = torch.repeat_interleave(starts + lens, lens).to(torch.int32)
    index = torch.where(real, starts[:, None] + torch.arange(width)[None, :], 0)
    return packed, seg, pos, lo, hi, index, att, mpos, mmask, qtype


def _given_or_own(self: torch.nn.Module, input_ids=None, attention_mask=None, **kwargs):
    """The encoder's forward, or the hidden states `PackedModel` computed for this call already."""
    given = getattr(self, "laya_aot_given", None)
    if given is not None:
        return types.SimpleNamespace(last_hidden_state=given)
    return self.laya_aot_forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


class PackedModel(ExplicitDtypeModel):
    """`ExplicitDtypeModel` whose encoder runs on packed rows (`pack`'s inputs): the same module tree, so the same
    parameter names. The encoder's attention is `modeling.attention`'s on every device (the Triton kernel on a
    GPU, its plain-torch reference elsewhere): only it reads `Segments`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from . import attention as attention_mod

        if kwargs.get("attention") == "stock":
            raise ValueError("export.rows=packed computes attention with laya-aot's own (segments within one row); "
                             "export.attention=stock cannot take packed rows: use export.attention=triton")
        encoder = self.model.encoder
        if self.attention != "triton":  # the CPU, or fp32: the kernel on a GPU, its plain-torch reference elsewhere
            why = attention_mod.kernel_available() if self.device_type == "cuda" else None
            if why or not attention_mod._install(self.model):
                raise ValueError("packed rows need a ModernBERT encoder whose attention laya_aot.modeling.attention "
                                 "computes: %s" % (why or "this checkpoint's encoder is not one"))
            self.attention = "triton" if self.device_type == "cuda" else "reference"
        encoder.laya_aot_forward = encoder.forward
        encoder.forward = types.MethodType(_given_or_own, encoder)

    def forward(self, input_ids, segments, positions, segment_lo, segment_hi, rows_index, attention_mask,
                marker_pos, marker_mask, qtype):
        encoder = self.model.encoder
        mask = Segments(segments, segment_lo, segment_hi, positions, rows_index, attention_mask)
        with self.region():
            h = encoder.laya_aot_forward(input_ids=input_ids, position_ids=positions,
                                         attention_mask={"full_attention": mask, "sliding_attention": mask})
        h = h.last_hidden_state
        encoder.laya_aot_given = h[0][rows_index]
        try:
            return super().forward(rows_index, attention_mask, marker_pos, marker_mask, qtype)
        finally:
            encoder.laya_aot_given = None

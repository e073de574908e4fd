"""The decision head's last layer computed only at the positions the answer reads (`export.head=answer_rows`).

laya's `DecisionModel.forward` runs every head layer over every token, then reads the result at two kinds of
position only: the markers (`gather(h, marker_pos)`, the option logits) and position 0 (the pooled row of the
action head). The last head layer's output is read nowhere else, so the exported copy computes that layer only
there: its attention takes the queries of those positions against the keys and values of every token, and its
feed-forward runs on those rows. Same weights and the same operations, row by row, so the same answers up to
rounding (the build verifies every artifact against laya's eager fp32 forward); the rest of the forward is laya's
own. The other positions of that layer's output are zeros, which nothing reads.

The layer learns the positions from the exported module (`ExplicitDtypeModel.forward` sets `answer_rows` for
the one call); without them it runs as the stock layer.
"""
from __future__ import annotations

from typing import Optional

import torch

HEADS = ("answer_rows", "full")


class AnswerRowsLayer(torch.nn.TransformerEncoderLayer):
    """laya's last head layer, computing only the rows `answer_rows` (N, S) names; the others are zeros.

    `install` gives the existing layer this class: its parameters keep their names, so an artifact still finds
    them in the checkpoint (an AOTInductor package takes its weights from there by name)."""

    answer_rows: Optional[torch.Tensor] = None

    def forward(self, src: torch.Tensor, src_mask=None, src_key_padding_mask=None, is_causal: bool = False):
        rows = self.answer_rows
        if rows is None or src_mask is not None:
            return super().forward(src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                                   is_causal=is_causal)
        take = rows[:, :, None].expand(-1, -1, src.size(-1))

        def attend(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            out = self.self_attn(q, kv, kv, key_padding_mask=src_key_padding_mask, need_weights=False)[0]
            return self.dropout1(out)

        x = src.gather(1, take)
        if self.norm_first:
            normed = self.norm1(src)
            x = x + attend(normed.gather(1, take), normed)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + attend(x, src))
            x = self.norm2(x + self._ff_block(x))
        return torch.zeros_like(src).scatter(1, take, x)


def answer_rows(marker_pos: torch.Tensor) -> torch.Tensor:
    """Position 0 and every marker position (as laya reads them: clamped at 0), (N, 1 + markers)."""
    return torch.cat([torch.zeros_like(marker_pos[:, :1]), marker_pos.clamp(min=0)], 1)


def install(model: torch.nn.Module) -> Optional[AnswerRowsLayer]:
    """Make the last head layer of laya's DecisionModel `model` an AnswerRowsLayer, in place; None where that
    layer is not the plain `nn.TransformerEncoderLayer` laya builds (then nothing changes)."""
    layers = getattr(getattr(model, "head", None), "layers", None)
    if not layers or type(layers[-1]) is not torch.nn.TransformerEncoderLayer:
        return None
    last = layers[-1]
    last.__class__ = AnswerRowsLayer
    return last

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

Every head layer of that copy also computes its self-attention batch-first (`attention`). laya's layers are
`batch_first`, and its attention module (`_DynamicMultiheadAttention`, like PyTorch's) transposes the input to
tokens x rows before three separate projections. Exported and compiled by Inductor, each projection ran as a GEMM
batched over tokens with the rows as its height: on the H200 the six of a two-layer head took 18.5 us each at
1 x 128 tokens, 111 us of a 1.26 ms forward (`benchmarks/results/calls.md`).
Here the projections run on the rows as laid out, one plain GEMM per input (queries, keys and values packed
where they are one tensor), then `scaled_dot_product_attention` with laya's padding mask, as laya computes it.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from . import gemm

HEADS = ("answer_rows", "full")


@contextlib.contextmanager
def attention_backends() -> Iterator[None]:
    """The attention kernels an artifact may be exported and compiled to: torch's own but cuDNN's.

    Given a masked 16-bit `scaled_dot_product_attention` on an H100, torch picks cuDNN's kernel, which builds an
    execution plan on the first call of every new shape: 30-100 ms for each (rows, tokens, markers) a service had
    not sent before, inside an AOTInductor package of `large-1024` (benchmarks/results/batching.md, "New shapes").
    Merged calls of mixed lengths keep making new shapes, so a busy service paid that plan on most calls. The
    memory-efficient kernel takes the same mask with no plan; the choice is made when the program is traced and
    compiled, so both run inside this."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield


def batch_first_ready(attn: torch.nn.Module) -> bool:
    """Whether `attention` computes what this attention module does in eval (laya's configuration of it)."""
    from ..laya_internals import head_attention_classes

    return (type(attn) in head_attention_classes() and attn.batch_first and attn._qkv_same_embed_dim
            and attn.in_proj_weight is not None and attn.bias_k is None and attn.bias_v is None
            and not attn.add_zero_attn and not attn.training)


def attention(attn: torch.nn.MultiheadAttention, q_in: torch.Tensor, kv_in: torch.Tensor,
              key_padding_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """`attn(q_in, kv_in, kv_in, key_padding_mask=..., need_weights=False)[0]` for batch-first inputs, with the
    projections on the rows as laid out. key_padding_mask: rows x keys, True (bool) or -inf (float) = not a key.
    On the faithful path (`faithful`) the projections are `gemm.linear`'s and the attention takes the weights'
    16-bit dtype (softmax in fp32 inside SDPA); the result is fp32."""
    e, heads = attn.embed_dim, attn.num_heads
    w, b = attn.in_proj_weight, attn.in_proj_bias
    faithful = getattr(attn, "laya_aot_faithful", False)
    name = getattr(attn, "laya_aot_name", "")

    def project(x: torch.Tensor, rows: slice) -> torch.Tensor:
        bias = None if b is None else b[rows]
        return gemm.linear(x, w[rows], bias, name + ".in_proj") if faithful else F.linear(x, w[rows], bias)

    if q_in is kv_in:
        q, k, v = project(q_in, slice(None)).chunk(3, -1)
    else:
        q = project(q_in, slice(None, e))
        k, v = project(kv_in, slice(e, None)).chunk(2, -1)
    n, lq = q.shape[0], q.shape[1]
    q, k, v = (t.reshape(n, t.shape[1], heads, e // heads).transpose(1, 2) for t in (q, k, v))
    if faithful:
        q, k, v = (t.to(w.dtype) for t in (q, k, v))
    # laya's own test: 0 (bool False, or the float mask TransformerEncoderLayer makes) = a key to attend
    mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :] == 0
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if faithful:
        out = out.float()
    return attn.out_proj(out.transpose(1, 2).reshape(n, lq, e))


class BatchFirstLayer(torch.nn.TransformerEncoderLayer):
    """laya's head layer with its self-attention computed by `attention` (the stock block where that does not
    apply); `install` gives the existing layer this class, so its parameters keep their names. `plain` (the
    faithful path, `faithful`): the layer's plain forward always, never torch's fused encoder-layer kernel, which
    takes its weights and input in one dtype."""

    plain: bool = False

    def forward(self, src: torch.Tensor, src_mask=None, src_key_padding_mask=None, is_causal: bool = False):
        if not self.plain or src_mask is not None or is_causal:
            return super().forward(src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                                   is_causal=is_causal)
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), None, src_key_padding_mask)
            return x + self._ff_block(self.norm2(x))
        x = self.norm1(x + self._sa_block(x, None, src_key_padding_mask))
        return self.norm2(x + self._ff_block(x))

    def _sa_block(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor],
                  key_padding_mask: Optional[torch.Tensor], is_causal: bool = False) -> torch.Tensor:
        if attn_mask is not None or is_causal or not batch_first_ready(self.self_attn):
            return super()._sa_block(x, attn_mask, key_padding_mask, is_causal)
        return self.dropout1(attention(self.self_attn, x, x, key_padding_mask))


class AnswerRowsLayer(BatchFirstLayer):
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
            if batch_first_ready(self.self_attn):
                return self.dropout1(attention(self.self_attn, q, kv, src_key_padding_mask))
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


def faithful(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Put laya's DecisionModel `model`'s decision head (a copy's) on the faithful path: every layer a
    BatchFirstLayer taking its plain forward, the self-attention's projections and the feed-forward's products
    `gemm.linear`s with their weights in `dtype`. False, changing nothing, where a layer is not the plain
    `nn.TransformerEncoderLayer` laya builds with the self-attention `attention` computes (its products then stay
    in fp32, as precise as laya's fp32 forward)."""
    layers = getattr(getattr(model, "head", None), "layers", None)
    if not layers:
        return True
    if not all(isinstance(layer, torch.nn.TransformerEncoderLayer) and batch_first_ready(layer.self_attn)
               for layer in layers):
        return False
    for i, layer in enumerate(layers):
        if type(layer) is torch.nn.TransformerEncoderLayer:
            layer.__class__ = BatchFirstLayer
        layer.plain = True
        attn = layer.self_attn
        attn.laya_aot_faithful, attn.laya_aot_name = True, "head.layers.%d.self_attn" % i
        gemm.cast_weight(attn, "in_proj_weight", dtype)
    return True


def install(model: torch.nn.Module) -> Optional[AnswerRowsLayer]:
    """Make the last head layer of laya's DecisionModel `model` an AnswerRowsLayer and the others BatchFirstLayers,
    in place; None where the last layer is not the plain `nn.TransformerEncoderLayer` laya builds (then nothing
    changes)."""
    layers = getattr(getattr(model, "head", None), "layers", None)
    if not layers or type(layers[-1]) is not torch.nn.TransformerEncoderLayer:
        return None
    for layer in layers[:-1]:
        if type(layer) is torch.nn.TransformerEncoderLayer:
            layer.__class__ = BatchFirstLayer
    last = layers[-1]
    last.__class__ = AnswerRowsLayer
    return last

"""Banded attention for the exported encoder: ModernBERT's local layers without an L x L mask (issue 24).

laya builds its encoder with transformers' `sdpa` attention: for every forward transformers materialises a
rows x L x L mask for the sliding-window (local) layers and one for the global layers, and each layer hands
SDPA a dense mask, so every local layer computes all L x L scores of which only a band of 2w+1 per query
counts. On the H200 at 32 x 1024 tokens that is about a third of the artifact's forward.

`banded(model)` switches a copy of the model (the one an artifact is exported from) to an attention function
registered with transformers under `NAME`, computing the same attention:
- global layers: SDPA with the padding mask as a rows x 1 x 1 x L key mask (broadcast, never expanded);
- local layers: queries in blocks of Q, each block against the Q + 2w keys its band can reach, with a
  Q x (Q + 2w) band mask (a few blocks of work per query instead of L; w is read from the mask the installed
  transformers builds, so the band is the one laya's own forward uses).
A query with no key to attend to (a padded position far from every token) attends to all the keys in reach
instead of producing NaN, as transformers' own SDPA mask does; what such positions hold is never read.
Whether the result equals laya's forward is what every artifact's verification measures, as for any export.
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

NAME = "laya_aot_banded"
_registered = False


def _register() -> None:
    """Register the attention and its mask function with transformers (once per process)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, padding_only)
    _registered = True


def padding_only(*args: Any, attention_mask: Optional[torch.Tensor] = None, **kwargs: Any) -> Optional[torch.Tensor]:
    """The mask `NAME` layers get: the rows x L padding mask as booleans (True = a token), never expanded."""
    return None if attention_mask is None else attention_mask.bool()


def band_halfwidth(config: Any) -> Optional[int]:
    """w such that the installed transformers' sliding-window mask for `config` lets query i attend key j
    exactly when |i - j| <= w (None: its mask is not such a band, or cannot be built here)."""
    sw = getattr(config, "sliding_window", None)
    if not isinstance(sw, int) or sw <= 0:
        return None
    try:
        from transformers.masking_utils import create_bidirectional_sliding_window_mask

        cfg = copy.copy(config)
        cfg._attn_implementation = "sdpa"
        n = 4 * sw + 16
        mask = create_bidirectional_sliding_window_mask(config=cfg, inputs_embeds=torch.zeros(1, n, 1),
                                                        attention_mask=torch.ones(1, n, dtype=torch.long),
                                                        allow_is_bidirectional_skip=False)
    except Exception as e:  # noqa: BLE001 - another transformers: the stock attention stays
        log.info("banded attention not used: transformers' sliding-window mask cannot be read (%s)", e)
        return None
    if not isinstance(mask, torch.Tensor) or mask.shape[-2:] != (n, n):
        return None
    allowed = (mask if mask.dtype == torch.bool else mask == 0).reshape(n, n)
    w = int(allowed[n // 2].nonzero().max()) - n // 2
    i = torch.arange(n)
    if w < 0 or not torch.equal(allowed, (i[:, None] - i[None, :]).abs() <= w):
        return None
    return w


def banded(model: torch.nn.Module) -> bool:
    """Switch `model`'s ModernBERT encoder (a copy laya never serves from) to `NAME`; False, changing nothing,
    when its encoder is not one this module knows the attention of."""
    encoder = getattr(model, "encoder", None)
    config = getattr(encoder, "config", None)
    if config is None or getattr(config, "model_type", None) != "modernbert" \
            or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    w = band_halfwidth(config)
    if w is None:
        return False
    _register()
    config._attn_implementation = NAME
    for m in encoder.modules():
        if hasattr(m, "sliding_window") and hasattr(m, "Wqkv"):  # ModernBertAttention
            m.laya_aot_band = w if m.sliding_window is not None else None
    return True


def block_size(w: int) -> int:
    """The queries per block for a band of half-width w (a multiple of 16, at least 2w)."""
    return max(16, -(-2 * w // 16) * 16)


def example_tokens(model: torch.nn.Module) -> int:
    """An export example length with more than one block of queries in every banded layer (a single block would
    be a size-1 dimension, which torch.export specialises the program to)."""
    bands = [m.laya_aot_band for m in model.modules() if getattr(m, "laya_aot_band", None) is not None]
    return 2 * block_size(max(bands)) + 16 if bands else 0


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
              **kwargs: Any) -> tuple:
    """transformers' attention interface: (rows, L, heads, head_dim) out, no weights."""
    w = getattr(module, "laya_aot_band", None)
    keep = attention_mask
    if w is None:
        mask = None
        if keep is not None:
            keep = keep | ~keep.any(-1, keepdim=True)   # a row of padding only attends to everything
            mask = keep[:, None, None, :]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    else:
        out = _local(query, key, value, keep, w, dropout, scaling)
    return out.transpose(1, 2).contiguous(), None


def _local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: Optional[torch.Tensor], w: int,
           dropout: float, scale: Optional[float]) -> torch.Tensor:
    """Attention where query i sees key j iff |i - j| <= w and j is a token: blocks of Q queries, each against
    its Q + 2w keys."""
    rows, heads, length, dim = q.shape
    block = block_size(w)
    span = block + 2 * w
    # one block more than the length needs: n >= 2 and n * block > length for every length, so torch.export
    # proves its size checks instead of specialising the program to one side of them
    n = (length + block - 1) // block + 1
    pad = n * block - length
    if keep is None:
        keep = torch.ones(rows, length, dtype=torch.bool, device=q.device)
    qb = F.pad(q, (0, 0, 0, pad)).view(rows, heads, n, block, dim).transpose(1, 2)
    kb = F.pad(k, (0, 0, w, pad + w)).unfold(2, span, block).permute(0, 2, 1, 4, 3)
    vb = F.pad(v, (0, 0, w, pad + w)).unfold(2, span, block).permute(0, 2, 1, 4, 3)
    kb = kb.reshape(rows * n, heads, span, dim)
    vb = vb.reshape(rows * n, heads, span, dim)
    qb = qb.reshape(rows * n, heads, block, dim)
    a = torch.arange(block, device=q.device)
    b = torch.arange(span, device=q.device)
    band = (a[:, None] - (b[None, :] - w)).abs() <= w                           # block x span
    reach = F.pad(keep, (w, pad + w), value=False).unfold(1, span, block)     # rows x n x span
    mask = band[None, None] & reach[:, :, None, :]                             # rows x n x block x span
    mask = mask | ~mask.any(-1, keepdim=True)
    mask = mask.reshape(rows * n, 1, block, span)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, dropout_p=dropout, scale=scale)
    out = out.view(rows, n, heads, block, dim).transpose(1, 2).reshape(rows, heads, n * block, dim)
    return out[:, :, :length]

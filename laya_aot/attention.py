"""Mask-free attention for the exported encoder on a GPU: flash attention's own window for ModernBERT's local
layers, no L x L masks (issue 24).

laya builds its encoder with transformers' `sdpa` attention. transformers then builds a rows x L x L mask for
the sliding-window (local) layers and one for the global layers, and SDPA with a dense mask runs cuDNN's
masked kernel over all L x L scores: at 32 x 1024 tokens on the H200, 19 ms of a 72 ms forward, plus about
6 ms rebuilding the masks in every layer.

`switch(model, ...)` makes a copy of the model (the one an artifact is exported from) compute the same
attention with `aten._flash_attention_forward`: local layers with its window (left = right = w, where w is
read from the mask the installed transformers builds, so the band is the one laya's own forward uses),
global layers without one, and no mask at all. A padding key is pushed out of every softmax by one extra head
dimension (the query's is 1; the key's is -BIG where it is padding and 0 where it is a token; the value's is
0), which adds exactly 0 to a token's score and -BIG * scale to a padding key's. Flash attention takes head
dimensions in steps of 8, so the head dimension grows by 8.
Only on CUDA in 16 bits (flash attention's domain); elsewhere the copy keeps transformers' attention. Whether
an artifact answers like laya's forward is what its verification measures, as for every export.
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

NAME = "laya_aot_flash_window"
EXTRA = 8          # head dimensions added for the padding penalty (flash attention's step)
BIG = 16384.0      # the penalty's size before the softmax scale: exact in bf16 and fp16
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
        log.info("flash-window attention not used: transformers' sliding-window mask cannot be read (%s)", e)
        return None
    if not isinstance(mask, torch.Tensor) or mask.shape[-2:] != (n, n):
        return None
    allowed = (mask if mask.dtype == torch.bool else mask == 0).reshape(n, n)
    w = int(allowed[n // 2].nonzero().max()) - n // 2
    i = torch.arange(n)
    if w < 0 or not torch.equal(allowed, (i[:, None] - i[None, :]).abs() <= w):
        return None
    return w


def switch(model: torch.nn.Module, device_type: str, dtype: torch.dtype) -> bool:
    """Switch `model`'s ModernBERT encoder (a copy laya never serves from) to `NAME` when it runs on a GPU in
    16 bits; False, changing nothing, otherwise or when its encoder is not one whose attention this knows."""
    if device_type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    return _install(model)


def _install(model: torch.nn.Module) -> bool:
    encoder = getattr(model, "encoder", None)
    config = getattr(encoder, "config", None)
    if config is None or getattr(config, "model_type", None) != "modernbert" \
            or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    heads = getattr(config, "num_attention_heads", 0)
    if not heads or (config.hidden_size // heads) % 8 or config.hidden_size // heads + EXTRA > 256:
        return False  # a head dimension flash attention does not take
    w = band_halfwidth(config)
    if w is None:
        return False
    _register()
    config._attn_implementation = NAME
    for m in encoder.modules():
        if hasattr(m, "sliding_window") and hasattr(m, "Wqkv"):  # ModernBertAttention
            m.laya_aot_window = w if m.sliding_window is not None else None
    return True


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
              **kwargs: Any) -> tuple:
    """transformers' attention interface: query, key, value rows x heads x L x D in; rows x L x heads x D out."""
    rows, heads, length, dim = query.shape
    dtype = torch.get_autocast_dtype("cuda") if query.is_cuda and torch.is_autocast_enabled("cuda") else query.dtype
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (query, key, value))   # rows x L x heads x D
    if attention_mask is not None:
        penalty = torch.where(attention_mask, 0.0, -BIG).to(dtype)          # rows x L
        q = torch.cat([q, F.pad(torch.ones_like(q[..., :1]), (0, EXTRA - 1))], -1)
        k = torch.cat([k, F.pad(penalty[:, :, None, None].expand(rows, length, heads, 1), (0, EXTRA - 1))], -1)
        v = F.pad(v, (0, EXTRA))
    out = _flash(q, k, v, scaling if scaling is not None else dim ** -0.5, getattr(module, "laya_aot_window", None))
    return out[..., :dim].contiguous(), None


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: Optional[int]) -> torch.Tensor:
    """Flash attention on rows x L x heads x D, keys within `window` of each query (None: all); on the CPU
    (tests only: no artifact is built this way there) the same computation with SDPA and a band mask."""
    if q.is_cuda:
        return torch.ops.aten._flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, False,
                                                       False, scale=scale, window_size_left=window,
                                                       window_size_right=window)[0]
    mask = None
    if window is not None:
        i = torch.arange(q.shape[1], device=q.device)
        mask = (i[:, None] - i[None, :]).abs() <= window
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                          scale=scale).transpose(1, 2)

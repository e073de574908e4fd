"""ModernBERT's attention without L x L masks for the encoder an artifact is exported from (issue 24).

laya builds its encoder with transformers' `sdpa` attention: every forward builds a rows x L x L mask for the
sliding-window (local) layers and one for the global layers, and SDPA with a dense mask runs cuDNN's masked
kernel over all L x L scores. On the H200 at 32 x 1024 tokens that was 19 ms of a 74 ms forward, plus 6 ms
rebuilding masks (benchmarks/results/calls.md).

`switch(model, ...)` makes a copy of the model (the one an artifact is exported from, never laya's own) compute
the same attention with `laya_aot.modeling.window_attention`'s Triton kernel: the rows x L padding mask read as it is,
local layers visiting only the keys their window reaches (w read from the mask the installed transformers
builds, so the band is the one laya's own forward uses). Only on CUDA in 16 bits, where triton is; elsewhere
the copy keeps transformers' attention. On the CPU (tests) `attention` computes the same thing in plain torch.
Whether an artifact answers like laya's forward is what its verification measures, as for every export.
"""
from __future__ import annotations

import copy
import logging
from typing import Any, NamedTuple, Optional

import torch

log = logging.getLogger(__name__)

NAME = "laya_aot_window"
ATTENTIONS = ("triton", "stock")  # export.attention
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
        log.info("window attention not used: transformers' sliding-window mask cannot be read (%s)", e)
        return None
    if not isinstance(mask, torch.Tensor) or mask.shape[-2:] != (n, n):
        return None
    allowed = (mask if mask.dtype == torch.bool else mask == 0).reshape(n, n)
    w = int(allowed[n // 2].nonzero().max()) - n // 2
    i = torch.arange(n)
    if w < 0 or not torch.equal(allowed, (i[:, None] - i[None, :]).abs() <= w):
        return None
    return w


def kernel_available() -> Optional[str]:
    """None when the Triton kernel can be used in this process, else why not."""
    try:
        from . import window_attention  # noqa: F401 - registers the op
    except Exception as e:  # noqa: BLE001 - no triton (a CPU install) or one too old for triton_op
        return "the window attention kernel cannot be loaded (%s: %s)" % (type(e).__name__, e)
    return None


def switch(model: torch.nn.Module, device_type: str, dtype: torch.dtype, wanted: str = "triton") -> str:
    """Switch `model`'s ModernBERT encoder (a copy laya never serves from) to `NAME` when it runs on a GPU in
    16 bits with triton; returns the attention the copy now computes ("stock": changed nothing, as on a CPU, in
    fp32, or for an encoder whose attention this does not know)."""
    if wanted == "stock" or device_type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return "stock"
    why = kernel_available()
    if why:
        log.warning("stock attention kept: %s", why)
        return "stock"
    if not _install(model):
        return "stock"
    return "triton"


def kernel_dtype(module: torch.nn.Module, query: torch.Tensor) -> torch.dtype:
    """The dtype the attention takes q, k and v in: the faithful path's matrix-product dtype where the module has one
    (`model.ExplicitDtypeModel`, no autocast there), else autocast's on a GPU, else the query's."""
    dtype = getattr(module, "laya_aot_dtype", None)
    if dtype is not None:
        return dtype
    return torch.get_autocast_dtype("cuda") if query.is_cuda and torch.is_autocast_enabled("cuda") else query.dtype


def _install(model: torch.nn.Module) -> bool:
    encoder = getattr(model, "encoder", None)
    config = getattr(encoder, "config", None)
    if config is None or getattr(config, "model_type", None) != "modernbert" \
            or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    heads = getattr(config, "num_attention_heads", 0)
    if not heads or config.hidden_size // heads > 256:
        return False
    w = band_halfwidth(config)
    if w is None:
        return False
    _register()
    config._attn_implementation = NAME
    for m in encoder.modules():
        if hasattr(m, "sliding_window") and hasattr(m, "Wqkv"):  # ModernBertAttention
            m.laya_aot_window = w if m.sliding_window is not None else None
    return True


class Segments(NamedTuple):
    """Packed rows' attention mask (`modeling.packed`), 1 x T each: `seg` numbers each position's segment (0:
    padding), `lo` and `hi` bound the positions of its segment (`window_attention.segment_attention`), `pos` is each
    position's place in its own row; `index` and `keep` (rows x L) lay the segments out as padded rows again."""

    seg: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    pos: torch.Tensor
    index: torch.Tensor
    keep: torch.Tensor


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: Optional[torch.Tensor | Segments], dropout: float = 0.0,
              scaling: Optional[float] = None, **kwargs: Any) -> tuple:
    """transformers' attention interface: query, key, value rows x heads x L x D in; rows x L x heads x D out. The
    mask is a rows x L padding mask, or packed rows' `Segments`."""
    rows, heads, length, dim = query.shape
    dtype = kernel_dtype(module, query)
    q, k, v = (t.to(dtype) if t.stride(-1) == 1 else t.to(dtype).contiguous() for t in (query, key, value))
    window = getattr(module, "laya_aot_window", None)
    scale = scaling if scaling is not None else dim ** -0.5
    if isinstance(attention_mask, Segments):
        s = attention_mask
        if q.is_cuda:
            out = torch.ops.laya_aot.segment_attention(q, k, v, s.seg, s.lo, s.hi, -1 if window is None else window,
                                                       scale)
        else:  # each segment as a padded row again: attention costs what the padded rows' does, not T x T
            laid_out = [t[0][:, s.index].transpose(0, 1) for t in (q, k, v)]  # rows x heads x L x D
            out = reference(*laid_out, s.keep, window, scale)[(s.seg[0].long() - 1).clamp(min=0), s.pos[0]][None]
        return out, None
    keep = attention_mask if attention_mask is not None else \
        torch.ones(rows, length, dtype=torch.bool, device=query.device)
    if q.is_cuda:
        out = torch.ops.laya_aot.window_attention(q, k, v, keep, -1 if window is None else window, scale)
    else:
        out = reference(q, k, v, keep, window, scale)
    return out, None


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, window: Optional[int],
              scale: float, segments: bool = False) -> torch.Tensor:
    """The kernel's attention in plain torch (softmax in fp32): rows x L x heads x D out; zeros where a query
    has no key (a padded position beyond every window: nothing reads it). `segments`: `keep` holds segment numbers
    (0: padding), and a query attends only the keys of its own segment."""
    length = q.shape[2]
    allowed = keep.bool()[:, None, None, :].expand(-1, 1, length, -1)
    if segments:
        allowed = allowed & (keep[:, None, :, None] == keep[:, None, None, :])
    if window is not None and window >= 0:
        i = torch.arange(length, device=q.device)
        allowed = allowed & ((i[:, None] - i[None, :]).abs() <= window)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    return torch.matmul(p, v.float()).transpose(1, 2).to(q.dtype)

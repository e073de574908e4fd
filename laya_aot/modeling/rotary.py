"""ModernBERT's rotary cos/sin read from a table in the exported copy, not recomputed in every layer (issue 24).

transformers' `ModernBertRotaryEmbedding` computes cos and sin of position x frequency on every forward. Inductor
inlines that computation into each layer's rotary kernel, so every layer evaluates sin and cos again for every
element of its queries and keys (once per head). On the H200 that kernel took 5.4 ms of a 65 ms forward at 32 x 1024
tokens (`benchmarks/results/calls.md`), mostly the sin and cos.

`tabulate(model, positions)` gives the export copy's rotary module (never laya's own) a table per layer type: the
values its own forward returns for positions 0 .. positions-1, computed once by that forward on the CPU in fp32.
The copy's forward then gathers rows of the table, cast to the dtype transformers would return. The tables are
non-persistent buffers, so an artifact carries them as extra constants (`kinds/aoti.constants_spec`). Only where
every rope type is "default" (no dynamic update of the frequencies) and the module has transformers 5's form;
otherwise nothing changes. Whether an artifact answers like laya's forward is what its verification measures.
"""
from __future__ import annotations

import inspect
import logging
import types
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)

ROTARY = ("table", "computed")  # export.rotary
PREFIX = "laya_aot_rope_"  # buffer names: laya_aot_rope_{cos,sin}_<layer type>


def rotary_module(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The ModernBERT encoder's rotary embedding module, or None when `model` has none laya-aot knows."""
    encoder = getattr(model, "encoder", None)
    rope = getattr(encoder, "rotary_emb", None)
    if rope is None or type(rope).__name__ != "ModernBertRotaryEmbedding":
        return None
    return rope


def why_not(rope: torch.nn.Module) -> Optional[str]:
    """Why `rope` cannot be tabulated (None: it can)."""
    types_ = getattr(rope, "layer_types", None)
    kinds = getattr(rope, "rope_type", None)
    if not types_ or not isinstance(kinds, dict):
        return "its rotary module has no layer_types/rope_type (another transformers)"
    dynamic = sorted(t for t in types_ if kinds.get(t, "default") != "default")
    if dynamic:
        return "rope type %s may update its frequencies with the length" % ", ".join(
            "%s=%s" % (t, kinds[t]) for t in dynamic)
    try:
        params = list(inspect.signature(rope.forward).parameters)
    except (TypeError, ValueError):
        return "its rotary forward has no readable signature"
    if params[:3] != ["x", "position_ids", "layer_type"]:
        return "its rotary forward takes (%s), not (x, position_ids, layer_type)" % ", ".join(params)
    return None


def tabulate(model: torch.nn.Module, positions: int) -> bool:
    """Make `model`'s (a copy's) rotary module read cos and sin for positions < `positions` from tables; False,
    changing nothing, where it cannot (the reason is logged)."""
    rope = rotary_module(model)
    if rope is None:
        return False
    why = why_not(rope)
    if why:
        log.info("rotary tables not used: %s", why)
        return False
    pos = torch.arange(positions, dtype=torch.long)[None]
    x = torch.zeros(1, dtype=torch.float32)
    for layer_type in rope.layer_types:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            cos, sin = _on_cpu(rope)(x, pos, layer_type)
        device = getattr(rope, layer_type + "_inv_freq").device
        rope.register_buffer(PREFIX + "cos_" + layer_type, cos[0].float().to(device), persistent=False)
        rope.register_buffer(PREFIX + "sin_" + layer_type, sin[0].float().to(device), persistent=False)
    rope.forward = types.MethodType(table_forward, rope)
    return True


def _on_cpu(rope: torch.nn.Module) -> Any:
    """The module's own forward run on a CPU copy (fp32, no TF32, whatever device the model is on)."""
    import copy

    return copy.deepcopy(rope).to("cpu").forward


def table_forward(self: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str) -> tuple:
    """transformers' rotary forward, read from the tables `tabulate` made: rows x L x D in x's dtype."""
    cos = getattr(self, PREFIX + "cos_" + layer_type)
    sin = getattr(self, PREFIX + "sin_" + layer_type)
    return cos[position_ids].to(dtype=x.dtype), sin[position_ids].to(dtype=x.dtype)

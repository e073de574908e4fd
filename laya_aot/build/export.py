"""Stage b: `torch.export` of laya's DecisionModel with explicit dtypes.

AOTInductor cannot compile a program exported under autocast (it carries dtype asserts), and a bf16
copy trips on the fp32 confidence features meeting a bf16 action head. So the exported module fixes
every dtype up front: encoder and decision head in the target dtype, the confidence features and the
action head in `action_head_dtype` (fp32 by default). laya's own forward already casts the action
head's input to the head's weight dtype when autocast is off, so the model itself is reused unchanged.

Tokens are declared as `16 * Dim`: a plain range trips the exporter's own `L % 8` alignment guard
on ModernBERT's attention mask.
"""
from __future__ import annotations

import copy
import logging
from typing import Dict, Tuple

import torch
from torch.export import Dim, ExportedProgram

from ..padding import TOKEN_MULTIPLE, Ranges

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INPUT_NAMES = ("input_ids", "attention_mask", "marker_pos", "marker_mask", "qtype")
OUTPUT_NAMES = ("logits", "act_logits")


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError("unknown dtype %r; use one of %s" % (name, ", ".join(DTYPES)))
    return DTYPES[name]


class ExplicitDtypeModel(torch.nn.Module):
    """laya's DecisionModel with fixed dtypes and fp32 outputs; the module every artifact is made from."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, action_head_dtype: torch.dtype):
        super().__init__()
        self.model = copy.deepcopy(model).eval().to(dtype)
        self.model.act_head.to(action_head_dtype)

    def forward(self, input_ids, attention_mask, marker_pos, marker_mask, qtype):
        logits, act_logits = self.model(input_ids, attention_mask, marker_pos, marker_mask, qtype)
        return logits.float(), act_logits.float()


def example_inputs(max_tokens: int, pad_id: int, device: str = "cpu") -> Tuple[torch.Tensor, ...]:
    """A batch whose sizes are all distinct and > 1, so the exporter specialises none of them."""
    g = torch.Generator().manual_seed(0)
    rows, tokens, markers = 3, min(48, max_tokens), 3
    ids = torch.randint(5, 200, (rows, tokens), generator=g)
    att = torch.ones(rows, tokens, dtype=torch.long)
    att[1, tokens - 5:] = 0
    ids[1, tokens - 5:] = pad_id
    mpos = torch.tensor([[2, 5, 9]] * rows)
    mmask = torch.ones(rows, markers, dtype=torch.bool)
    qtype = torch.tensor([0, 1, 2])
    return tuple(t.to(device) for t in (ids, att, mpos, mmask, qtype))


def dynamic_shapes(max_rows: int, max_tokens: int, max_markers: int) -> Dict[str, Dict[int, object]]:
    rows = Dim("rows", min=1, max=max_rows)
    tokens = TOKEN_MULTIPLE * Dim("tokens_16", min=1, max=max_tokens // TOKEN_MULTIPLE)
    markers = Dim("markers", min=2, max=max_markers)
    return {"input_ids": {0: rows, 1: tokens}, "attention_mask": {0: rows, 1: tokens},
            "marker_pos": {0: rows, 1: markers}, "marker_mask": {0: rows, 1: markers}, "qtype": {0: rows}}


def export_model(module: ExplicitDtypeModel, max_rows: int, max_tokens: int, max_markers: int,
                 pad_id: int, device: str = "cpu") -> ExportedProgram:
    if max_tokens < 2 * TOKEN_MULTIPLE or max_tokens % TOKEN_MULTIPLE:
        raise ValueError("export.max_tokens=%d must be a multiple of %d and at least %d"
                         % (max_tokens, TOKEN_MULTIPLE, 2 * TOKEN_MULTIPLE))
    args = example_inputs(max_tokens, pad_id, device)
    with torch.no_grad():
        return torch.export.export(module.to(device), args, strict=False,
                                   dynamic_shapes=dynamic_shapes(max_rows, max_tokens, max_markers))


def ranges_of(ep: ExportedProgram) -> Ranges:
    """The ranges the exporter actually proved, read from the program's input shapes.

    They can be narrower than asked (the exporter raised the token minimum to 32 for ModernBERT), and the
    runtime must pad to what the program accepts, not to what was requested.
    """
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    user_inputs = [n for n in placeholders if n.name in ep.graph_signature.user_inputs]
    ids_shape = user_inputs[0].meta["val"].shape
    mpos_shape = user_inputs[2].meta["val"].shape

    def bounds(sym) -> Tuple[int, int]:
        if isinstance(sym, int):
            return sym, sym
        expr = sym.node.expr
        vr = ep.range_constraints.get(expr)
        if vr is None:  # an expression such as 16*s2: bound it through its free symbol
            (free,) = expr.free_symbols
            inner = ep.range_constraints[free]
            scale = int(expr / free)
            return int(inner.lower) * scale, int(inner.upper) * scale
        return int(vr.lower), int(vr.upper)

    r0, r1 = bounds(ids_shape[0])
    t0, t1 = bounds(ids_shape[1])
    m0, m1 = bounds(mpos_shape[1])
    return Ranges(min_rows=r0, max_rows=r1, min_tokens=t0, max_tokens=t1, min_markers=m0, max_markers=m1)

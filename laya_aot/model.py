"""laya's DecisionModel with every dtype fixed up front: the module every artifact is made from.

AOTInductor cannot compile a program exported under autocast (it carries dtype asserts), and a bf16
copy trips on the fp32 confidence features meeting a bf16 action head. So the exported module fixes
every dtype up front: encoder and decision head in the target dtype, the confidence features and the
action head in `action_head_dtype` (fp32 by default). laya's own forward already casts the action
head's input to the head's weight dtype when autocast is off, so the model itself is reused unchanged.
"""
from __future__ import annotations

import copy
import logging

import torch

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

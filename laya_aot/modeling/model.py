"""laya's DecisionModel as an artifact computes it: the module every artifact is made from.

Two precision policies for a 16-bit artifact (`export.precision`):

- "laya" computes the way laya serves (`laya_aot.numerics.precision`): matrix products in bf16/fp16 under autocast,
  layer norms, softmax, the residual stream and the embeddings in fp32. Not a model cast wholly to 16 bits: a
  wholly-bf16 copy of a checkpoint with decisive answers was ten times further from fp32 than laya's own bf16
  forward. So the module keeps laya's fp32 weights, casts once what autocast would cast on every call (the
  weights of `nn.Linear` layers), and runs the forward under `torch.autocast` in the target dtype. torch.export
  records the autocast region (`wrap_with_autocast`), and AOTInductor and torch.compile compile it.
- "faithful" (`gemm` given) runs without autocast: fp32 everywhere but the matrix products of the encoder and the
  decision head's layers, which take their inputs and weights in `gemm` with fp32 accumulation and hand back fp32
  (`laya_aot.modeling.gemm`); the scorer, and so the option logits, stay fp32. `gemm` is fp16 where the checkpoint's
  activations stay in range (`gemm_extremes`, judged by `precision.gemm_dtype`), else bf16.

The action head runs in `action_head_dtype` (fp32 by default: outside autocast, as precise as eager fp32; set it
to the target dtype to match laya's own forward there too).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import types
from typing import Iterable, Optional

import torch

from . import attention as attention_mod
from . import gemm as gemm_mod
from . import head as head_mod
from . import rotary as rotary_mod

log = logging.getLogger(__name__)

INPUT_NAMES = ("input_ids", "attention_mask", "marker_pos", "marker_mask", "qtype")
OUTPUT_NAMES = ("logits", "act_logits")


def _cast_linears(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast every nn.Linear's weight and bias to `dtype`: what autocast casts on each call, done once."""
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            m.to(dtype)


class _HeadInDtype(torch.nn.Module):
    """The action head in its own dtype, outside the model's autocast region."""

    def __init__(self, head: torch.nn.Sequential, dtype: torch.dtype, device_type: str):
        super().__init__()
        self.head, self.dtype, self.device_type = head, dtype, device_type
        if dtype != torch.float32:
            _cast_linears(head, dtype)

    def __getitem__(self, i: int) -> torch.nn.Module:  # laya reads act_head[0].weight.dtype without autocast
        return self.head[i]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            return self.head(x.float())


def _faithful(model: torch.nn.Module, gemm: torch.dtype) -> None:
    """Put the encoder's and the decision head's matrix products of `model` (a copy) on the faithful path: weights
    in `gemm`, `gemm_mod.linear` as their forward; the scorer and the action head are left as they are."""
    head_ok = head_mod.faithful(model, gemm)
    if not head_ok:
        log.info("the decision head's layers are not the ones laya builds: their products stay in fp32")
    parts = [("encoder", getattr(model, "encoder", None))] + ([("head", model.head)] if head_ok else [])
    for prefix, part in parts:
        if part is None:
            continue
        for name, m in part.named_modules():
            if isinstance(m, torch.nn.Linear):
                gemm_mod.cast_weight(m, "weight", gemm)
                m.laya_aot_name = "%s.%s" % (prefix, name)
                m.forward = types.MethodType(gemm_mod.linear_forward, m)
            if hasattr(m, "laya_aot_window"):  # a ModernBertAttention switched to laya_aot.modeling.attention's kernel
                m.laya_aot_dtype = gemm


def check_choices(attention: str, head: str) -> None:
    """export.attention and export.head: one ValueError naming the setting (the build checks them as it starts)."""
    if attention not in attention_mod.ATTENTIONS:
        raise ValueError("export.attention=%r: one of %s" % (attention, ", ".join(attention_mod.ATTENTIONS)))
    if head not in head_mod.HEADS:
        raise ValueError("export.head=%r: one of %s" % (head, ", ".join(head_mod.HEADS)))


class ExplicitDtypeModel(torch.nn.Module):
    """laya's DecisionModel under autocast in `dtype` (no autocast for fp32), fp32 outputs; with `gemm`, the
    faithful path instead: no autocast, matrix products in `gemm` (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, action_head_dtype: torch.dtype,
                 device_type: str = "cpu", attention: str = "stock", rope_table: int = 0, head: str = "full",
                 gemm: Optional[torch.dtype] = None):
        super().__init__()
        check_choices(attention, head)
        self.model = copy.deepcopy(model).eval().float()
        self.dtype, self.device_type = dtype, device_type
        # what the copy computes attention with: "triton" only on a GPU in 16 bits, for an encoder
        # laya_aot.attention knows
        self.attention = attention_mod.switch(self.model, device_type, dtype, attention)
        # "table": the rotary cos/sin read from tables of `rope_table` positions (modeling.rotary); "computed": as
        # transformers computes them on every forward
        self.rotary = "table" if rope_table > 0 and rotary_mod.tabulate(self.model, rope_table) else "computed"
        # "answer_rows": the head's last layer computed only at position 0 and the markers (modeling.head); "full":
        # over every token, as laya does. Kept out of the module tree: the layer stays where laya's model has it
        self._answer_rows_layer = [head_mod.install(self.model)] if head == "answer_rows" else [None]
        self.head = "answer_rows" if self._answer_rows_layer[0] is not None else "full"
        # "faithful": no autocast, matrix products in `gemm`; "laya": autocast in `dtype` (fp32: neither applies)
        self.precision = "faithful" if gemm is not None else "laya"
        if gemm is not None:
            _faithful(self.model, gemm)
            if action_head_dtype != torch.float32:
                self.model.act_head = _HeadInDtype(self.model.act_head, action_head_dtype, device_type)
        elif dtype != torch.float32:
            head = self.model.act_head
            self.model.act_head = torch.nn.Identity()  # the head's linears follow action_head_dtype, not dtype
            _cast_linears(self.model, dtype)
            if action_head_dtype == dtype:
                _cast_linears(head, dtype)
                self.model.act_head = head
            else:
                self.model.act_head = _HeadInDtype(head, action_head_dtype, device_type)
        elif action_head_dtype != torch.float32:
            self.model.act_head.to(action_head_dtype)  # laya casts the head's input to its weight dtype

    def forward(self, input_ids, attention_mask, marker_pos, marker_mask, qtype):
        last = self._answer_rows_layer[0]
        if last is None:
            return self._forward(input_ids, attention_mask, marker_pos, marker_mask, qtype)
        last.answer_rows = head_mod.answer_rows(marker_pos)
        try:
            return self._forward(input_ids, attention_mask, marker_pos, marker_mask, qtype)
        finally:
            last.answer_rows = None

    def _forward(self, input_ids, attention_mask, marker_pos, marker_mask, qtype):
        with self.region():
            logits, act_logits = self.model(input_ids, attention_mask, marker_pos, marker_mask, qtype)
        return logits.float(), act_logits.float()

    def region(self) -> contextlib.AbstractContextManager:
        """Where the model runs: under autocast in `dtype` for laya's policy in 16 bits, else no autocast region."""
        if self.dtype == torch.float32 or self.precision == "faithful":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


def gemm_extremes(model: torch.nn.Module, batches: Iterable[tuple], device: str) -> gemm_mod.Extremes:
    """The largest |input| and |output| of the faithful path's matrix products over `batches`, on fp32 forwards of
    `model` (laya's DecisionModel, left as it is) on `device`: what decides whether fp16 holds them."""
    module = ExplicitDtypeModel(model, torch.float32, torch.float32, torch.device(device).type,
                                gemm=torch.float32).to(device)
    with torch.no_grad(), torch.autocast(torch.device(device).type, enabled=False), gemm_mod.record() as seen:
        for batch in batches:
            module(*(t.to(device) for t in batch))
    return seen

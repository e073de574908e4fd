"""Stage d: ONNX model for ONNX Runtime on the CPU, usable by laya's own `ONNXAgent` too.

Exported from an fp32 ExportedProgram through torch's dynamo exporter with the input names and
dtypes ONNXAgent feeds (int64 ids/mask/positions/qtype, bool marker mask) and the output names it
asks for (`logits`, `act_logits`). Every axis stays symbolic, so ONNXAgent's unpadded token counts
run too; the runtime still pads to the verified multiple of 16.
"""
from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path
from typing import Any, Dict

from torch.export import ExportedProgram

from .export import OUTPUT_NAMES

log = logging.getLogger(__name__)


def export_onnx(ep: ExportedProgram, path: Path) -> Dict[str, Any]:
    import onnx
    import torch

    quiet = [logging.getLogger(n) for n in ("onnxscript", "torch.onnx", "onnx_ir")]
    levels = [q.level for q in quiet]
    try:
        for q in quiet:
            q.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(ep, (), dynamo=True, optimize=True, verify=False, verbose=False,
                                        report=False, output_names=list(OUTPUT_NAMES))
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path))
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    names = [i.name for i in model.graph.input]
    if names != ["input_ids", "attention_mask", "marker_pos", "marker_mask", "qtype"]:
        raise RuntimeError("the ONNX model's inputs are %s, not the names laya's ONNXAgent feeds" % names)
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=None)
    return {"opset": opset, "onnx_version": onnx.__version__}

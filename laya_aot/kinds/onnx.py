"""ONNX for ONNX Runtime on the CPU, usable by laya's own `ONNXAgent` too.

Exported from an fp32 ExportedProgram through torch's dynamo exporter with the input names and
dtypes ONNXAgent feeds (int64 ids/mask/positions/qtype, bool marker mask) and the output names it
asks for (`logits`, `act_logits`). Every axis stays symbolic, so ONNXAgent's unpadded token counts
run too; the runtime still pads to the verified multiple of 16.
"""
from __future__ import annotations

import contextlib
import io
import logging
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torch.export import ExportedProgram

from ..manifest import Artifact, Needs
from ..modeling.model import INPUT_NAMES, OUTPUT_NAMES, ExplicitDtypeModel
from .base import BuildContext, Built, Exported, Kind, LoadEnv, Outputs, Runner
from .exported_program import export_model

log = logging.getLogger(__name__)

NAME = "onnx"


def export_onnx(ep: ExportedProgram, path: Path) -> Dict[str, Any]:
    import onnx

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
    if names != list(INPUT_NAMES):
        raise RuntimeError("the ONNX model's inputs are %s, not the names laya's ONNXAgent feeds" % names)
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=None)
    return {"opset": opset, "onnx_version": onnx.__version__}


class ONNXRunner(Runner):
    """ONNX Runtime on the CPU, with the input names and dtypes laya's ONNXAgent feeds."""

    def __init__(self, path: Path, threads: Optional[int] = None):
        import onnxruntime as ort

        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = threads
        self._session = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
        self.stats = {}

    def __call__(self, ids, att, mpos, mmask, qtype) -> Outputs:
        feed = {name: t.cpu().numpy() for name, t in zip(INPUT_NAMES, (ids, att, mpos, mmask, qtype))}
        logits, act = self._session.run(list(OUTPUT_NAMES), feed)
        return torch.from_numpy(logits), torch.from_numpy(act)


def build(ctx: BuildContext, exported: Exported) -> Built:
    """Exported from an fp32 program (ONNX Runtime runs on the CPU), whatever the target's dtype."""
    ep, r = exported.program, exported.ranges
    if exported.dtype != "fp32" or exported.rows != "padded":  # ONNX Runtime takes the padded rows
        module = ExplicitDtypeModel(ctx.agent.model, torch.float32, torch.float32)
        ep = export_model(module, r.max_rows, r.max_tokens, r.max_markers, ctx.pad_id)
    t0 = time.perf_counter()
    facts = export_onnx(ep, ctx.staging / "onnx" / "model.onnx")
    ctx.add_artifact(KIND, "%s-fp32" % NAME, "onnx/model.onnx", "cpu", "fp32", time.perf_counter() - t0,
                     details=facts)
    return Built("opset %s" % facts["opset"])


def load(path: Path, art: Artifact, env: LoadEnv) -> Runner:
    # as many threads as torch's intra-op pool, which laya serve caps with LAYA_THREADS (and torch.set_num_threads
    # or OMP_NUM_THREADS set): the cap holds whichever artifact serves; torch's default is ONNX Runtime's own
    return ONNXRunner(path, threads=torch.get_num_threads())


def refuse_device(device: str) -> Optional[str]:
    if device != "cpu":
        return "ONNX Runtime runs on the CPU and this agent runs on %s, where the GPU forward is faster" % device
    return None


KIND = Kind(name=NAME, stage="onnx", build=build, load=load, order=3, serves_dtype_head=False, fixed_dtype="fp32",
            needs=lambda m, device: Needs(device="cpu"), variant=lambda m, device: "onnx-any",
            refuse_device=refuse_device, interchangeable=True)

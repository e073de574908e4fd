"""Runners: one small class per artifact kind, each turning padded tensors into (logits, act_logits).

The build's verify stage and the runtime use the same runners, so what was verified is what runs.
AOTInductor packages are built without weights inside (`package_constants_in_so=False`): a runner is
handed the model's tensors (the checkpoint's weights, already loaded by laya) and supplies them
as the package's constants, converted to the artifact's dtype once.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

log = logging.getLogger(__name__)

AOTI_PACKAGE = "model.pt2"
AOTI_CONSTANTS = "constants.json"
AOTI_EXTRA = "extra_constants.safetensors"

Outputs = Tuple[torch.Tensor, torch.Tensor]


class Runner:
    """Runs one artifact; `device` is where its inputs must live."""

    kind = "?"
    device = torch.device("cpu")

    def __call__(self, ids, att, mpos, mmask, qtype) -> Outputs:  # pragma: no cover - interface
        raise NotImplementedError


class AOTIRunner(Runner):
    """An AOTInductor package whose weights come from the checkpoint at load time."""

    kind = "aoti"

    def __init__(self, art_dir: Path, tensors: Mapping[str, torch.Tensor], device: str = "cpu"):
        from safetensors.torch import load_file

        art_dir = Path(art_dir)
        self.device = torch.device(device)
        spec = json.loads((art_dir / AOTI_CONSTANTS).read_text(encoding="utf-8"))
        extra = load_file(str(art_dir / AOTI_EXTRA)) if (art_dir / AOTI_EXTRA).exists() else {}
        t0 = time.perf_counter()
        self._compiled = load_aoti_package(art_dir / AOTI_PACKAGE, self._index())
        self.stats = {"load_package_s": round(time.perf_counter() - t0, 3)}
        self._lock = threading.Lock()
        self._consts: Dict[str, torch.Tensor] = {}
        if spec.get("frozen"):  # weights folded into the package at build time
            return
        t0 = time.perf_counter()
        wanted = set(self._compiled.get_constant_fqns())
        missing = wanted - set(spec["constants"])
        if missing:
            raise KeyError("the package needs constants its constants.json does not describe: %s"
                           % sorted(missing)[:3])
        consts: Dict[str, torch.Tensor] = {}
        for fqn, src in spec["constants"].items():
            if fqn not in wanted:  # folded or unused by the compiled graph
                continue
            dtype = getattr(torch, src["dtype"])
            if src["source"] == "model":
                if src["key"] not in tensors:
                    raise KeyError("the checkpoint has no tensor %r that this AOTInductor package needs; "
                                   "the bundle was built from another model architecture" % src["key"])
                t = tensors[src["key"]]
            else:
                t = extra[fqn]
            # .to() returns the tensor itself when dtype and device already match: no second copy of
            # the weights for an fp32 CPU artifact
            consts[fqn] = t.detach().to(device=self.device, dtype=dtype).contiguous()
        self._compiled.load_constants(consts, check_full_update=True, user_managed=True)
        self._consts = consts  # user_managed: the package reads these tensors in place; keep them alive
        self.stats["constants_s"] = round(time.perf_counter() - t0, 3)

    def _index(self) -> int:
        if self.device.type != "cuda":
            return -1
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def __call__(self, ids, att, mpos, mmask, qtype) -> Outputs:
        with self._lock:
            logits, act = self._compiled(ids, att, mpos, mmask, qtype)
        return logits, act


def load_aoti_package(path: Path, device_index: int):
    """An AOTInductor package straight from torch's C++ package loader.

    `torch._inductor.package.load_package` first calls `codecache.get_device_information()`, only to log
    a warning when the build machine differs; that call dry-compiles a test library per CPU vector ISA
    and dlopens each in a child Python. On the H200 image it cost 35-48 s of every load
    (benchmarks/results/aoti_load_time.md). laya-aot checks that an artifact fits this machine itself
    (laya_aot.variant) before loading it, so it goes to the C++ loader directly, as that function
    does after its check; torch's own route remains the fallback for a torch without that binding.
    """
    try:
        from torch.export.pt2_archive._package import AOTICompiledModel

        make = torch._C._aoti.AOTIModelPackageLoader
    except (ImportError, AttributeError):
        make = None
    if make is not None:
        try:
            loader = make(str(path), "model", False, 1, device_index)
        except TypeError:  # another signature in this torch: use its public route
            loader = None
        if loader is not None:
            return AOTICompiledModel(loader)
    from torch._inductor.package import load_package

    return load_package(str(path), device_index=device_index)


class ONNXRunner(Runner):
    """ONNX Runtime on the CPU, with the input names and dtypes laya's ONNXAgent feeds."""

    kind = "onnx"

    def __init__(self, path: Path, threads: Optional[int] = None):
        import onnxruntime as ort

        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = threads
        self._session = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])

    def __call__(self, ids, att, mpos, mmask, qtype) -> Outputs:
        feed = {"input_ids": ids.cpu().numpy(), "attention_mask": att.cpu().numpy(),
                "marker_pos": mpos.cpu().numpy(), "marker_mask": mmask.cpu().numpy(), "qtype": qtype.cpu().numpy()}
        logits, act = self._session.run(["logits", "act_logits"], feed)
        return torch.from_numpy(logits), torch.from_numpy(act)


class ExportedProgramRunner(Runner):
    """The portable ExportedProgram run as a module (verification only: it is eager speed)."""

    kind = "exported_program"

    def __init__(self, path: Path, device: str = "cpu"):
        self.device = torch.device(device)  # the device the program was exported on
        self._module = torch.export.load(str(path)).module()

    def __call__(self, ids, att, mpos, mmask, qtype) -> Outputs:
        with torch.no_grad():
            return self._module(ids, att, mpos, mmask, qtype)


class CompileRunner(Runner):
    """torch.compile of the explicit-dtype model, with the bundle's Inductor cache loaded first."""

    kind = "compile"

    def __init__(self, art_dir: Path, model: torch.nn.Module, device: str = "cuda"):
        from ..build.inductor_cache import CACHE_FILE, INFO_FILE, compiled_module

        info = json.loads((Path(art_dir) / INFO_FILE).read_text(encoding="utf-8"))
        torch.compiler.load_cache_artifacts((Path(art_dir) / CACHE_FILE).read_bytes())
        self.device = torch.device(device)
        self._module, self._fn = compiled_module(model, info["dtype"], info["action_head_dtype"], device)
        self._lock = threading.Lock()

    def __call__(self, ids, att, mpos, mmask, qtype) -> Outputs:
        from ..build.inductor_cache import pad_rows

        n = ids.shape[0]
        with self._lock, torch.no_grad():  # one compile at a time; Dynamo's cache is process-wide
            logits, act = self._fn(*pad_rows((ids, att, mpos, mmask, qtype)))
        return logits[:n].clone(), act[:n].clone()


class TileLangRunner(Runner):
    """laya's own fast path fed only the bundle's precompiled TileLang kernels (laya_aot.kernels)."""

    kind = "tilelang"

    def __init__(self, art_dir: Path, agent, entry: Mapping[str, object]):
        from ..kernels import make_fast_forward

        details = entry.get("details") or {}
        self.device = agent.device
        self._fast = make_fast_forward(agent, Path(art_dir), str((entry.get("needs") or {}).get("gpu_arch")),
                                       details.get("kernels"))

    def __call__(self, ids, att, mpos, mmask, qtype) -> Outputs:
        return self._fast.forward(ids, att, mpos, mmask, qtype)


def model_tensors(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter and buffer of a DecisionModel by name, non-persistent buffers included."""
    out = dict(model.named_parameters())
    out.update(dict(model.named_buffers()))
    return out


def make_runner(kind: str, path: Path, tensors: Optional[Mapping[str, torch.Tensor]] = None,
                device: str = "cpu", model: Optional[torch.nn.Module] = None, agent=None,
                entry: Optional[Mapping[str, object]] = None) -> Runner:
    """The runner for an artifact entry's kind; raises ValueError for kinds that do not run here."""
    factories: Dict[str, Callable[[], Runner]] = {
        "aoti": lambda: AOTIRunner(path, tensors or {}, device),
        "onnx": lambda: ONNXRunner(path),
        "exported_program": lambda: ExportedProgramRunner(path, device),
        "compile": lambda: CompileRunner(path, model, device),
        "tilelang": lambda: TileLangRunner(path, agent, entry or {}),
    }
    if kind not in factories:
        raise ValueError("no runner for artifact kind %r" % kind)
    return factories[kind]()

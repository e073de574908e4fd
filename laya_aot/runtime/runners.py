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

    def __init__(self, art_dir: Path, tensors: Mapping[str, torch.Tensor], device: str = "cpu",
                 cuda_graphs: bool = False):
        from safetensors.torch import load_file

        art_dir = Path(art_dir)
        self.device = torch.device(device)
        spec = json.loads((art_dir / AOTI_CONSTANTS).read_text(encoding="utf-8"))
        extra = load_file(str(art_dir / AOTI_EXTRA)) if (art_dir / AOTI_EXTRA).exists() else {}
        t0 = time.perf_counter()
        self._compiled = load_aoti_package(art_dir / AOTI_PACKAGE, self._index())
        self.stats: Dict[str, object] = {"load_package_s": round(time.perf_counter() - t0, 3)}
        self._lock = threading.Lock()
        self._consts: Dict[str, torch.Tensor] = {}
        self._run = self._plain_run()
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda":
            from .graphs import GraphedCalls

            self.graphs = GraphedCalls(self._run)
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

    def _plain_run(self) -> Callable[..., Outputs]:
        """The package's C++ `run` on a list of tensors: no pytree specs parsed on every call."""
        loader = getattr(self._compiled, "loader", None)
        if loader is None or not hasattr(loader, "run"):
            return lambda *xs: tuple(self._compiled(*xs))
        return lambda *xs: tuple(loader.run(list(xs)))

    def __call__(self, ids, att, mpos, mmask, qtype) -> Outputs:
        with self._lock:
            fn = self.graphs if self.graphs is not None else self._run
            logits, act = fn(ids, att, mpos, mmask, qtype)
        return logits, act


def synthetic_constants(art_dir: Path, checkpoint: Path, device: str) -> Dict[str, torch.Tensor]:
    """Stand-in weights for an AOTInductor package: the checkpoint's shapes, read from the safetensors
    header only, filled with a small constant. The probe child only has to show that the package loads
    and runs on this machine without crashing; whether its answers are right is checked in-process
    (smoke check) with the real weights, so the child need not read gigabytes of them."""
    from safetensors import safe_open

    spec = json.loads((Path(art_dir) / AOTI_CONSTANTS).read_text(encoding="utf-8"))
    out: Dict[str, torch.Tensor] = {}
    with safe_open(str(Path(checkpoint) / "model.safetensors"), framework="pt") as f:
        for src in spec.get("constants", {}).values():
            if src["source"] != "model":
                continue
            key = src["key"]
            shape = f.get_slice(key).get_shape()
            dtype = getattr(torch, src["dtype"])
            fill = 0.01 if dtype.is_floating_point else 0
            out[key] = torch.full(shape, fill, dtype=dtype, device=device)
    return out


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
            # run_single_threaded=True: no per-call CUDA event bookkeeping in the container (AOTIRunner
            # serialises calls itself), which is also what lets a call be captured in a CUDA graph
            loader = make(str(path), "model", True, 1, device_index)
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
        from ..build import inductor_cache as route

        self._route = route  # its padding, dynamic marking, MHA switch and counters, for every call
        t0 = time.perf_counter()
        info = json.loads((Path(art_dir) / route.INFO_FILE).read_text(encoding="utf-8"))
        if info.get("options") != route.COMPILE_OPTIONS:  # its saved graphs would miss: a compile from scratch
            raise ValueError("it was compiled with options %r, this laya-aot compiles with %r: rebuild the bundle"
                             % (info.get("options"), route.COMPILE_OPTIONS))
        torch.compiler.load_cache_artifacts((Path(art_dir) / route.CACHE_FILE).read_bytes())
        self.device = torch.device(device)
        self._module, self._fn = route.compiled_module(model, info["dtype"], info["action_head_dtype"], device)
        self._lock = threading.Lock()
        self._first = True
        self.stats: Dict[str, object] = {"load_cache_artifacts_s": round(time.perf_counter() - t0, 3)}

    def __call__(self, ids, att, mpos, mmask, qtype) -> Outputs:
        route = self._route
        n = ids.shape[0]
        # one compile at a time (Dynamo's cache is process-wide); autocast off: laya's agent calls its
        # forward under bf16 autocast on CUDA, and Dynamo guards on the autocast state, so a call under
        # it would compile a second graph from scratch that the saved cache does not hold (59 s on the
        # H200, run 6). The module casts to its dtype itself.
        with self._lock, torch.no_grad(), torch.autocast(self.device.type, enabled=False), route.no_mha_fastpath():
            if self._first:  # what the first call cost, and whether it came from the saved cache
                before, t0 = route.cache_counters(), time.perf_counter()
            logits, act = self._fn(*route.mark_dynamic_batch(route.pad_rows((ids, att, mpos, mmask, qtype))))
            if self._first:
                self._first = False
                self.stats["first_call_s"] = round(time.perf_counter() - t0, 3)
                after = route.cache_counters()
                self.stats.update({"first_call_" + k: after[k] - before[k] for k in after})
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
                entry: Optional[Mapping[str, object]] = None, cuda_graphs: bool = False) -> Runner:
    """The runner for an artifact entry's kind; raises ValueError for kinds that do not run here.

    `cuda_graphs`: replay small calls of a CUDA AOTInductor package as CUDA graphs (runtime.graphs)."""
    factories: Dict[str, Callable[[], Runner]] = {
        "aoti": lambda: AOTIRunner(path, tensors or {}, device, cuda_graphs),
        "onnx": lambda: ONNXRunner(path),
        "exported_program": lambda: ExportedProgramRunner(path, device),
        "compile": lambda: CompileRunner(path, model, device),
        "tilelang": lambda: TileLangRunner(path, agent, entry or {}),
    }
    if kind not in factories:
        raise ValueError("no runner for artifact kind %r" % kind)
    return factories[kind]()

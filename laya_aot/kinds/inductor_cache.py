"""The compile route (CUDA targets): stage and switch `inductor_cache`, manifest kind `compile`.

The build compiles the explicit-dtype model once, as one graph with dynamic rows, tokens and markers
(`mark_dynamic_batch`), ahead of time: `torch.compile(...).aot_compile(...)` and `save_compiled_function`
(format `precompiled`). A serving process loads that function with `torch.compiler.load_compiled_function`
and calls it: no Dynamo trace, no AOTAutograd, no Inductor (a saved Inductor cache still left Dynamo's trace
and AOTAutograd to every start: 10 s of a ModernBERT-large start on an H200). Its guards are saved with it,
so a batch outside them is one error, never a recompile. Such a function is bound to the exact torch, Python,
triton and GPU it was compiled on: its `Needs` say so (`precompiled_needs`), and `misfit` refuses it
elsewhere before anything is loaded. The function takes laya's module as its argument (its weights are read from
it at each call), and loading it needs a transformers model instance in the process anyway: its saved guards
check the key order of transformers' `_CAN_RECORD_REGISTRY`, which a model's construction fills (in a process
without one, building the guards fails with an IndexError). So this route cannot start without laya's module.

Where this torch cannot precompile (no API, or it fails), the build falls back to the previous format,
`inductor_cache`: `torch.compiler.save_cache_artifacts()`, which `CompileRunner` loads before its first
compile (`cache_counters` tells a hit from a compile); the stage's facts record why. Either format is kept
only if a fresh process loads it as the runtime does (`check_in_fresh_process`). Only the batch's dimensions
are dynamic: `dynamic=True` would make every float attribute symbolic and Dynamo trace the model twice.
The manifest name stays `compile` for bundles already built; `NAME` and `STAGE` are where the two names meet.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from ..errors import one_line
from ..manifest import Artifact, Needs
from ..modeling.model import ExplicitDtypeModel
from ..numerics.dtypes import torch_dtype
from ..padding import Ranges
from ..variant import Machine, traced_packages
from .base import BuildContext, Built, Exported, Kind, LoadEnv, Misfit, Outputs, Runner, Skip

log = logging.getLogger(__name__)

NAME = "compile"  # the manifest's kind and the artifacts' names; the stage and switch: STAGE
STAGE = "inductor_cache"

CACHE_FILE = "inductor_cache.bin"
PRECOMPILED_FILE = "precompiled.bin"
INFO_FILE = "compile.json"
# compile.json's `format`: what the artifact holds (absent in bundles built before precompiled functions: a cache)
PRECOMPILED, INDUCTOR_CACHE = "precompiled", "inductor_cache"
COMPILE_OPTIONS: Dict[str, Any] = {"dynamic": None, "fullgraph": True}


# Dynamo specialises a dimension of size 1, so a one-row call would compile a second graph; the runner
# pads such a call to MIN_ROWS rows instead, and one dynamic graph serves every request.
MIN_ROWS = 2
# likewise options (markers): a masked extra option leaves every output as it was (its probability is 0)
MIN_MARKERS = 2


def warm_shapes(ranges: Ranges) -> List[Tuple[int, int]]:
    """(rows, tokens) run at build: one multi-row batch compiles the dynamic graph every request uses."""
    return [(max(MIN_ROWS, min(4, ranges.max_rows)), ranges.padded_tokens(min(ranges.max_tokens, 128)))]


@contextlib.contextmanager
def no_mha_fastpath() -> Iterator[None]:
    """Turn off PyTorch's fused nn.TransformerEncoderLayer path (laya's decision head) for a call.

    Under no_grad, with an even head count (16 in a ModernBERT-large-sized head), the layer calls
    `torch._transformer_encoder_layer_fwd`, which torch 2.11's Dynamo cannot trace with fake tensors:
    a graph break (fullgraph fails the build; without it the head ran eagerly outside the compiled
    graph). With the switch off the layer takes its plain path, the same maths Inductor fuses itself.
    The switch is process-wide: eager calls that overlap one of ours also take the plain path."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def mark_dynamic_batch(batch: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
    """Mark rows (every input) and tokens/markers (the 2-D inputs) dynamic, so one graph serves all."""
    for t in batch:
        for dim in range(t.dim()):
            torch._dynamo.maybe_mark_dynamic(t, dim)
    return batch


def cache_counters() -> Dict[str, int]:
    """Dynamo's graph count and Inductor's FX-graph / AOTAutograd cache hits and misses so far."""
    from torch._dynamo.utils import counters

    return {"dynamo_graphs": int(counters["stats"]["unique_graphs"]),
            "fxgraph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
            "fxgraph_cache_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
            "autograd_cache_hit": int(counters["aot_autograd"]["autograd_cache_hit"]),
            "autograd_cache_miss": int(counters["aot_autograd"]["autograd_cache_miss"])}


# what counts as a trace or a compile in `compile_counters` (cache hits are not compiles, but a hit still follows a
# Dynamo trace, which `dynamo_graphs` counts)
COMPILE_KEYS = ("dynamo_graphs", "aot_autograd_traces", "inductor_lowerings", "fxgraph_cache_miss",
                "autograd_cache_miss")


def compile_counters() -> Dict[str, int]:
    """`cache_counters` plus AOTAutograd's traces and Inductor's graph lowerings so far in this process: what a
    serving process that loaded a precompiled function must never add to (`compiles`)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    out = cache_counters()
    out["aot_autograd_traces"] = int(counters["aot_autograd"]["total"])
    out["inductor_lowerings"] = len(compilation_time_metrics.get("GraphLowering.run", ()))
    return out


def compiles(before: Dict[str, int], after: Dict[str, int]) -> int:
    """Traces and compiles between two `compile_counters` readings."""
    return sum(after[k] - before[k] for k in COMPILE_KEYS)


def pad_rows(batch: Tuple[torch.Tensor, ...], rows: int = MIN_ROWS) -> Tuple[torch.Tensor, ...]:
    """Repeat the last row until the batch has `rows` rows (outputs of the copies are dropped)."""
    n = batch[0].shape[0]
    if n >= rows:
        return batch
    return tuple(torch.cat([t, t[-1:].expand(rows - n, *t.shape[1:])], 0) for t in batch)


def pad_markers(batch: Tuple[torch.Tensor, ...], markers: int = MIN_MARKERS) -> Tuple[torch.Tensor, ...]:
    """Add masked options (position 0, mask False) until the batch has `markers`: their probability is 0, so
    every row's answer stays as it was (laya clamps its option count to 2 already)."""
    ids, att, mpos, mmask, qtype = batch
    k = mpos.shape[1]
    if k >= markers:
        return batch
    rows = mpos.shape[0]
    return (ids, att, torch.cat([mpos, mpos.new_zeros(rows, markers - k)], 1),
            torch.cat([mmask, mmask.new_zeros(rows, markers - k)], 1), qtype)


def _gemm(name: Optional[str]) -> Optional[torch.dtype]:
    return torch_dtype(name) if name else None


def compiled_module(model: torch.nn.Module, dtype: str, action_head_dtype: str, device: str,
                    gemm: Optional[str] = None):
    """The explicit-dtype model (`gemm`: the faithful path's matrix-product dtype, None for laya's policy) and its
    torch.compile."""
    module = ExplicitDtypeModel(model, torch_dtype(dtype), torch_dtype(action_head_dtype),
                                torch.device(device).type, gemm=_gemm(gemm)).to(device)
    return module, torch.compile(module, **COMPILE_OPTIONS)


def _batch(rows: int, tokens: int, markers: int, device: str):
    g = torch.Generator().manual_seed(rows * 1000 + tokens)
    ids = torch.randint(5, 200, (rows, tokens), generator=g)
    mpos = torch.arange(1, markers + 1).repeat(rows, 1)
    return tuple(t.to(device) for t in (ids, torch.ones_like(ids), mpos, torch.ones((rows, markers), dtype=torch.bool),
                                        torch.zeros(rows, dtype=torch.long)))


def _own_cache_artifacts() -> contextlib.AbstractContextManager:
    """A record of cache artifacts of its own for one compile, so that `save_cache_artifacts()` saves exactly what it
    used, cache hits included. The process-wide record saves an artifact only in the first save after it was seen,
    and a saved blob keeps one save's entries of each type: a second compile of the same graph in one process (the
    fallback after a build of the same model, or after the failed precompile) saved a cache without its AOTAutograd
    entry, which the fresh-process check refused; a precompile's own entries rode along in the fallback's file."""
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:  # a torch without the record has no save_cache_artifacts either: the build says so
        return contextlib.nullcontext()
    fresh = getattr(CacheArtifactManager, "with_fresh_cache", None)
    return fresh() if fresh is not None else contextlib.nullcontext()


def build_cache(agent, out_dir: Path, ranges: Ranges, dtype: str, action_head_dtype: str = "fp32",
                device: str = "cuda", gemm: Optional[str] = None) -> Dict[str, Any]:
    """Compile for the warm shapes and write the cache artifacts; returns facts for the manifest."""
    torch._dynamo.reset()
    with _own_cache_artifacts():
        return _build_cache(agent, out_dir, ranges, dtype, action_head_dtype, device, gemm)


def _build_cache(agent, out_dir: Path, ranges: Ranges, dtype: str, action_head_dtype: str,
                 device: str, gemm: Optional[str]) -> Dict[str, Any]:
    _, fn = compiled_module(agent.model, dtype, action_head_dtype, device, gemm)
    timings = {}
    graphs_before = cache_counters()["dynamo_graphs"]
    with torch.no_grad(), no_mha_fastpath():
        for rows, tokens in warm_shapes(ranges):
            t0 = time.perf_counter()
            fn(*mark_dynamic_batch(_batch(rows, tokens, 4, device)))
            if device == "cuda":
                torch.cuda.synchronize()
            timings["%dx%d" % (rows, tokens)] = round(time.perf_counter() - t0, 3)
    graphs = cache_counters()["dynamo_graphs"] - graphs_before
    if graphs != 1:
        raise RuntimeError("the compile route compiled %d graphs for its warm shapes, expected one dynamic graph"
                           % graphs)
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        raise RuntimeError("torch.compiler.save_cache_artifacts() returned nothing: no compiled code to save")
    data, info = saved
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CACHE_FILE).write_bytes(data)
    (out_dir / INFO_FILE).write_text(json.dumps({"format": INDUCTOR_CACHE, "options": COMPILE_OPTIONS,
                                                 "dtype": dtype, "action_head_dtype": action_head_dtype,
                                                 "gemm": gemm, "shapes": list(timings),
                                                 "compile_seconds": timings}, indent=1))
    return {"shapes": list(timings), "compile_seconds": timings, "bytes": len(data)}


def precompile_unavailable() -> Optional[str]:
    """Why this torch cannot save and load a precompiled function (None: it has the API; whether it works for
    this model the build finds out, and falls back to the saved cache when it does not)."""
    missing = [name for name, ok in (
        ("torch.compiler.load_compiled_function", hasattr(torch.compiler, "load_compiled_function")),
        ("torch._dynamo.aot_compile", importlib.util.find_spec("torch._dynamo.aot_compile") is not None)) if not ok]
    return "torch %s has no %s" % (torch.__version__, " or ".join(missing)) if missing else None


# the guard kinds torch cannot serialise (torch 2.13's CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
_UNSERIALISABLE = ("DICT_VERSION", "NN_MODULE", "ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "MODULE_MATCH",
                   "CLOSURE_MATCH", "WEAKREF_ALIVE")


def _saved_guards(entries) -> List[bool]:
    """Which guards a precompiled function keeps: those on the inputs and the module's structure (shapes with
    the dynamic dimensions' ranges, dtypes, devices, strides, grad mode), checked before every call; not global
    ones nor object identities, which another process cannot check (and which torch refuses to save: its
    default filter lets through an identity guard a module attribute derives, and the save fails). Nor the type
    of an object whose class was made inside a function: no other process has that class (transformers >= 5.25
    with `kernels` installed gives each ModernBERT attention such a wrapper of its rotary function)."""
    from torch._dynamo.guards import CheckFunctionManager

    bad = set(getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", _UNSERIALISABLE))
    return [not (e.is_global or e.guard_type in bad or bad.intersection(getattr(e, "derived_guard_types", ()) or ())
                 or _local_type(e)) for e in entries]


def _local_type(entry) -> bool:
    """A type guard on an object of a class defined in local scope (torch cannot save it, `_saved_guards`)."""
    if entry.guard_type not in ("TYPE_MATCH", "BUILTIN_MATCH") or not getattr(entry, "has_value", False):
        return False
    t = type(entry.value)
    return t.__qualname__ != t.__name__


@contextlib.contextmanager
def _aot_compile_enabled() -> Iterator[None]:
    """torch.compile(...).aot_compile exists only under `enable_aot_compile` in the torch releases that have the
    switch (on by default in 2.13); set while the function is compiled."""
    cfg = torch._dynamo.config
    if not hasattr(cfg, "enable_aot_compile"):
        yield
        return
    with cfg.patch(enable_aot_compile=True):
        yield


def _system_of(fn, device: str) -> Dict[str, Optional[str]]:
    """What torch checks before it runs a precompiled function (`SystemInfo`), as `Needs` fields; from the function
    itself where this torch records it there, else from this process."""
    from ..variant import current_machine

    m = current_machine(device)
    info = getattr(getattr(fn, "_artifacts", None), "system_info", None)
    triton = getattr(info, "triton_version", None)
    return {"torch_build": getattr(info, "torch_version", None) or m.torch_build,
            "python_build": getattr(info, "python_version", None) or m.python_build,
            "triton": ".".join(map(str, triton)) if triton and tuple(triton) != (0, 0) else m.triton,
            "gpu_name": getattr(info, "gpu_name", None) or m.gpu_name,
            "traced_packages": traced_packages()}


def precompiled_needs(needs: Needs, system: Dict[str, Optional[str]]) -> Needs:
    """`needs` bound to the exact build the function was compiled on and the packages it traced
    (`misfit` refuses any other); the GPU's facts only for a CUDA artifact, as torch checks them only
    there."""
    gpu = needs.device == "cuda"
    return dataclasses.replace(needs, torch_build=system["torch_build"], python_build=system["python_build"],
                               triton=system["triton"] if gpu else None, gpu_name=system["gpu_name"] if gpu else None,
                               traced_packages=system.get("traced_packages"))


def build_precompiled(agent, out_dir: Path, ranges: Ranges, dtype: str, action_head_dtype: str = "fp32",
                      device: str = "cuda", gemm: Optional[str] = None) -> Dict[str, Any]:
    """Compile the explicit-dtype model ahead of time for every (rows, tokens, markers) in `ranges` and save the
    function; returns facts for the manifest. Raises where this torch cannot (the build then falls back)."""
    why = precompile_unavailable()
    if why:
        raise RuntimeError(why)
    torch._dynamo.reset()
    module = ExplicitDtypeModel(agent.model, torch_dtype(dtype), torch_dtype(action_head_dtype),
                                torch.device(device).type, gemm=_gemm(gemm)).to(device)
    ((rows, tokens),) = warm_shapes(ranges)
    example = mark_dynamic_batch(_batch(rows, tokens, max(MIN_MARKERS, min(4, ranges.max_markers)), device))
    t0 = time.perf_counter()
    # the unbound forward, the module its first argument: its weights are inputs, read from the serving
    # process's module at each call, and the file holds code only
    with _aot_compile_enabled(), torch.no_grad(), no_mha_fastpath():
        fn = torch.compile(type(module).forward, **COMPILE_OPTIONS, options={"guard_filter_fn": _saved_guards}) \
            .aot_compile(((module,) + example, {}))
        if device == "cuda":
            torch.cuda.synchronize()
    seconds = round(time.perf_counter() - t0, 3)
    out_dir.mkdir(parents=True, exist_ok=True)
    fn.save_compiled_function(str(out_dir / PRECOMPILED_FILE))
    size = (out_dir / PRECOMPILED_FILE).stat().st_size
    system = _system_of(fn, device)
    shape = "%dx%d" % (rows, tokens)
    (out_dir / INFO_FILE).write_text(json.dumps({"format": PRECOMPILED, "options": COMPILE_OPTIONS, "dtype": dtype,
                                                 "action_head_dtype": action_head_dtype, "gemm": gemm,
                                                 "ranges": ranges.as_dict(),
                                                 "system": system, "shapes": [shape],
                                                 "compile_seconds": {shape: seconds}}, indent=1))
    return {"format": PRECOMPILED, "shapes": [shape], "compile_seconds": {shape: seconds}, "bytes": size,
            "system": system}


def _info(art_dir: Path) -> Dict[str, Any]:
    return json.loads((Path(art_dir) / INFO_FILE).read_text(encoding="utf-8"))


class PrecompiledRunner(Runner):
    """The precompiled function of the explicit-dtype model: loaded, then called with the module. Nothing is
    traced or compiled here (`stats["compiles_since_load"]` counts what the process did anyway); a batch its
    saved guards refuse is one ValueError, never a recompile."""

    def __init__(self, art_dir: Path, model: torch.nn.Module, device: str = "cuda"):
        t0 = time.perf_counter()
        info = _info(art_dir)
        self._before = compile_counters()
        with open(Path(art_dir) / PRECOMPILED_FILE, "rb") as f:
            self._fn = torch.compiler.load_compiled_function(f)
        loaded = time.perf_counter()
        self.device = torch.device(device)
        self.ranges = Ranges.from_dict(info["ranges"])
        self._module = ExplicitDtypeModel(model, torch_dtype(info["dtype"]), torch_dtype(info["action_head_dtype"]),
                                          self.device.type, gemm=_gemm(info.get("gemm"))).to(device)
        self._first = True
        self.stats: Dict[str, object] = {"format": PRECOMPILED, "load_compiled_function_s": round(loaded - t0, 3),
                                         "load_s": round(time.perf_counter() - t0, 3)}

    def __call__(self, ids, att, mpos, mmask, qtype) -> Outputs:
        n, k = ids.shape[0], mpos.shape[1]
        why = self.ranges.out_of_range(ids.shape[1], mpos.shape[1])
        if why:
            raise ValueError("a batch of %d tokens and %d options is outside the precompiled function's ranges (%s)"
                             % (ids.shape[1], mpos.shape[1], why))
        batch = tuple(t.contiguous() for t in pad_rows(pad_markers((ids, att, mpos, mmask, qtype))))
        t0 = time.perf_counter()
        # autocast off as in CompileRunner: the function was compiled without it, and its grad-mode and global
        # state guards refuse a call under another state rather than compute in it
        with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
            try:
                logits, act = self._fn(self._module, *batch)
            except RuntimeError as e:
                if "GuardManager check failed" not in str(e):
                    raise
                raise ValueError("the precompiled function's saved guards refuse a batch of shapes %s (it never "
                                 "recompiles; rebuild the bundle with ranges that hold it)"
                                 % [tuple(t.shape) for t in batch]) from None
        if self._first:
            self._first = False
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.stats["first_call_s"] = round(time.perf_counter() - t0, 3)
        self.stats["compiles_since_load"] = compiles(self._before, compile_counters())
        return logits[:n, :k].clone(), act[:n].clone()


class CompileRunner(Runner):
    """torch.compile of the explicit-dtype model, with the bundle's Inductor cache loaded first (the format a
    build falls back to, and every bundle built before precompiled functions holds)."""

    def __init__(self, art_dir: Path, model: torch.nn.Module, device: str = "cuda"):
        t0 = time.perf_counter()
        info = _info(art_dir)
        if info.get("options") != COMPILE_OPTIONS:  # its saved graphs would miss: a compile from scratch
            raise ValueError("it was compiled with options %r, this laya-aot compiles with %r: rebuild the bundle"
                             % (info.get("options"), COMPILE_OPTIONS))
        torch.compiler.load_cache_artifacts((Path(art_dir) / CACHE_FILE).read_bytes())
        self.device = torch.device(device)
        self._module, self._fn = compiled_module(model, info["dtype"], info["action_head_dtype"], device,
                                                 info.get("gemm"))
        self._lock = threading.Lock()
        self._first = True
        self.stats: Dict[str, object] = {"format": INDUCTOR_CACHE,
                                         "load_cache_artifacts_s": round(time.perf_counter() - t0, 3)}

    def __call__(self, ids, att, mpos, mmask, qtype) -> Outputs:
        n = ids.shape[0]
        # one compile at a time (Dynamo's cache is process-wide); autocast off: laya's agent calls its
        # forward under bf16 autocast on CUDA, and Dynamo guards on the autocast state, so a call under
        # it would compile a second graph from scratch that the saved cache does not hold. The module
        # casts to its dtype itself.
        with self._lock, torch.no_grad(), torch.autocast(self.device.type, enabled=False), no_mha_fastpath():
            if self._first:  # what the first call cost, and whether it came from the saved cache
                before, t0 = cache_counters(), time.perf_counter()
            logits, act = self._fn(*mark_dynamic_batch(pad_rows((ids, att, mpos, mmask, qtype))))
            if self._first:
                self._first = False
                self.stats["first_call_s"] = round(time.perf_counter() - t0, 3)
                after = cache_counters()
                self.stats.update({"first_call_" + k: after[k] - before[k] for k in after})
        return logits[:n].clone(), act[:n].clone()


FRESH_MARK = "FRESH-PROCESS "
# the fresh process's sanity bound on option and action probabilities against the module's eager forward in the
# artifact's dtype (the build's verification applies the real rule afterwards): a function that loads but
# computes something else is not shipped
FRESH_BOUND = {"fp32": 1e-3, "bf16": 0.05, "fp16": 0.05}


def check_in_fresh_process(art_dir: Path, ckpt: Path, device: str, timeout_s: float = 900) -> Dict[str, Any]:
    """Load the artifact as the runtime does, in a child with empty Inductor and Triton caches, and return what
    it cost there (the runner's `stats`). A precompiled function must run there with no trace and no compile and
    answer like the eager module; a saved cache must serve its one Dynamo trace without an Inductor compile.

    Why a child: the build process has compiled the graph already and may differ from a fresh one in
    state that enters the cache key (AOTInductor once changed an Inductor config value in place), so only
    a fresh process shows whether the runtime will load what was saved or compile from scratch."""
    with tempfile.TemporaryDirectory(prefix="laya-aot-cache-check-") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        p = subprocess.run([sys.executable, "-m", __name__, str(art_dir), str(ckpt), device],
                           capture_output=True, text=True, env=env, timeout=timeout_s)
    line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith(FRESH_MARK)), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError("a fresh process could not run the saved %s (exit %d): %s"
                           % (_info(art_dir).get("format", INDUCTOR_CACHE), p.returncode,
                              (p.stderr.strip().splitlines() or ["no output"])[-1]))
    stats = json.loads(line[len(FRESH_MARK):])
    if stats.get("format") == PRECOMPILED:
        if stats.get("compiles_since_load") != 0:
            raise RuntimeError("the precompiled function traced or compiled in a fresh process (%s): the runtime "
                               "would compile" % {k: stats.get("fresh_" + k) for k in COMPILE_KEYS})
        bound = FRESH_BOUND.get(stats.get("dtype"), 0.05)
        if not stats.get("max_abs_prob", 1.0) <= bound:
            raise RuntimeError("the precompiled function answers unlike the eager module in a fresh process (largest "
                               "probability difference %s, bound %g)" % (stats.get("max_abs_prob"), bound))
        return stats
    misses = stats.get("first_call_fxgraph_cache_miss", 0) + stats.get("first_call_autograd_cache_miss", 0)
    if misses or stats.get("first_call_dynamo_graphs") != 1:
        raise RuntimeError("the saved Inductor cache did not serve a fresh process (graphs %s, FX-graph misses %s, "
                           "AOTAutograd misses %s): the runtime would compile from scratch"
                           % (stats.get("first_call_dynamo_graphs"), stats.get("first_call_fxgraph_cache_miss"),
                              stats.get("first_call_autograd_cache_miss")))
    return stats


def _max_abs_prob(got: Outputs, ref: Outputs) -> float:
    return max(float((torch.softmax(a.float(), -1) - torch.softmax(b.float(), -1)).abs().max())
               for a, b in zip(got, ref))


def _fresh_process_main(art_dir: str, ckpt: str, device: str) -> None:
    from .. import laya_internals as laya_api

    # laya's module as the runtime's loader builds it for this kind (a thin agent given build_eager_module's)
    agent = laya_api.eager_agent(ckpt, device=device)
    start = compile_counters()
    runner = load_runner(Path(art_dir), agent.model, device)
    batch = _batch(MIN_ROWS, 32, 2, device)
    got = runner(*batch)
    stats = dict(runner.stats)
    if isinstance(runner, PrecompiledRunner):
        # one row and one option (the paddings) at another length, then eager on both, outside the count
        odd = _batch(1, 48, 1, device)
        got_odd = runner(*odd)
        stats = dict(runner.stats)
        end = compile_counters()
        stats.update({"fresh_" + k: end[k] - start[k] for k in COMPILE_KEYS})
        stats["dtype"] = _info(Path(art_dir))["dtype"]
        with torch.no_grad():
            stats["max_abs_prob"] = max(_max_abs_prob(got, runner._module(*pad_rows(batch))),
                                        _max_abs_prob(got_odd, runner._module(*odd)))
    print(FRESH_MARK + json.dumps(stats), flush=True)


def faithful_gemm(exported: Exported) -> Optional[str]:
    """The program's matrix-product dtype on the faithful path (None: laya's policy, or fp32), which the compile
    route compiles its own module with."""
    p = exported.precision
    return p.gemm if p is not None and p.policy == "faithful" and p.gemm != "fp32" else None


def _build_cache_artifact(ctx: BuildContext, exported: Exported, out: Path) -> Dict[str, Any]:
    facts = build_cache(ctx.agent, out, exported.ranges, ctx.dtype, ctx.cfg.export.action_head_dtype, ctx.device,
                        faithful_gemm(exported))
    facts["format"] = INDUCTOR_CACHE
    try:
        facts["fresh_process"] = check_in_fresh_process(out, ctx.ckpt, ctx.device)
    except BaseException:
        _discard(ctx, out.name)  # nothing of a cache that would not be used
        raise
    return facts


def _discard(ctx: BuildContext, name: str) -> None:
    """Remove what this stage wrote under the build's own staging directory (never anything else)."""
    shutil.rmtree(ctx.staging / name, ignore_errors=True)


def build(ctx: BuildContext, exported: Exported) -> Built:
    """Compile on the build machine's GPU and save a precompiled function, kept only if a fresh process runs it
    without compiling; where it cannot be, the saved Inductor cache as before, and the reason in the facts."""
    if ctx.device != "cuda":
        raise Skip("the compile route is built for CUDA targets; on the CPU the AOTInductor package is the "
                   "compiled artifact")
    if not torch.cuda.is_available():
        raise Skip("target %s needs its GPU on the build machine to compile the model"
                   % ctx.cfg.target.name)
    return build_artifact(ctx, exported)


def build_artifact(ctx: BuildContext, exported: Exported) -> Built:
    """`build` past its CUDA gate, on `ctx.device` (the tests drive it on the CPU)."""
    name = ctx.artifact_name(KIND)
    out = ctx.staging / name
    t0 = time.perf_counter()
    try:
        facts = build_precompiled(ctx.agent, out, exported.ranges, ctx.dtype, ctx.cfg.export.action_head_dtype,
                                  ctx.device, faithful_gemm(exported))
        facts["fresh_process"] = check_in_fresh_process(out, ctx.ckpt, ctx.device)
    except Exception as e:  # noqa: BLE001 - recorded; the saved cache is built instead
        why = one_line(e)
        log.warning("laya-aot: no precompiled function for the compile route (%s); saving an Inductor cache "
                    "instead", why)
        _discard(ctx, name)
        facts = _build_cache_artifact(ctx, exported, out)
        facts["precompile_failed"] = why
    seconds = time.perf_counter() - t0
    art = ctx.add_artifact(KIND, name, name, ctx.device, ctx.dtype, seconds, details=facts,
                           precision=exported.precision)
    record = {"format": facts["format"]}
    if facts["format"] == PRECOMPILED:
        art.needs = precompiled_needs(art.needs, facts["system"])
        summary = "precompiled function, %.1f MB; a fresh process ran it with no compile (first call %.2f s)" % (
            facts["bytes"] / 1e6, facts["fresh_process"].get("first_call_s", 0.0))
    else:
        record["precompile_failed"] = facts["precompile_failed"]
        summary = "Inductor cache (no precompiled function: %s), %.1f MB; a fresh process hit it (first call " \
                  "%.1f s)" % (facts["precompile_failed"], facts["bytes"] / 1e6,
                               facts["fresh_process"].get("first_call_s", 0.0))
    return Built(summary, record=record)


def load_runner(path: Path, model: torch.nn.Module, device: str) -> Runner:
    """The runner of either format (compile.json's `format`; none: a saved cache, as every older bundle holds)."""
    if _info(path).get("format", INDUCTOR_CACHE) == PRECOMPILED:
        return PrecompiledRunner(path, model, device)
    return CompileRunner(path, model, device)


def load(path: Path, art: Artifact, env: LoadEnv) -> Runner:
    return load_runner(path, env.model, env.device)


def misfit(art: Artifact, m: Machine) -> Optional[Misfit]:
    """Why `m` is not the exact build a precompiled function was compiled on, or lacks the packages whose code it
    traced (None: it is, or `art.needs` does not ask: an Inductor cache, every bundle built before). torch refuses
    such a function on load (or worse, runs kernels built for another GPU); this says it before anything is
    loaded, as one reason (the exact build includes torch's minor version) with its fix."""
    needs = art.needs
    facts = [("torch_build", "torch", m.torch_build), ("python_build", "Python", m.python_build)]
    if needs.device == "cuda":
        facts += [("triton", "triton", m.triton), ("gpu_name", "GPU", m.gpu_name)]
    differ = [(key, "%s %s, this process has %s" % (what, getattr(needs, key), have or "none"))
              for key, what, have in facts if getattr(needs, key) and str(getattr(needs, key)) != have]
    if differ:
        return Misfit("a precompiled function runs only on the exact build it was compiled on (%s): rebuild the "
                      "compile route with this machine's torch (`laya-aot build` here)"
                      % "; ".join(d for _, d in differ), software=all(key != "gpu_name" for key, _ in differ))
    if not needs.traced_packages:
        return None
    want = dict(p.split("==", 1) for p in needs.traced_packages.split())
    have = dict(p.split("==", 1) for p in (m.traced_packages or traced_packages()).split())
    diffs = ["%s %s, this process has %s" % (name, v, have.get(name, "none"))
             for name, v in want.items() if have.get(name, "none") != v]
    if not diffs:
        return None
    return Misfit("a precompiled function runs only with the packages whose code it traced (%s): rebuild the "
                  "compile route with this process's packages (`laya-aot build` here)" % "; ".join(diffs))


# not native: Python plus Triton kernels (a precompiled function too: torch checks its build before it runs a
# kernel, and the manifest's needs before that); loaded in-process, where a failure is an exception the loader
# catches like any other
KIND = Kind(name=NAME, stage=STAGE, build=build, load=load, order=2, reverify=False, needs_module=True, misfit=misfit)


if __name__ == "__main__":
    _fresh_process_main(*sys.argv[1:4])

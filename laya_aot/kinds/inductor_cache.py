"""The compile route with a pre-populated Inductor cache (CUDA targets): stage and switch `inductor_cache`.

The build compiles the explicit-dtype model once, as one graph with dynamic batch dimensions
(`mark_dynamic_batch`), and saves `torch.compiler.save_cache_artifacts()`; `CompileRunner` loads them
before its first compile, so a fresh process skips Inductor and Triton (Dynamo and AOTAutograd still
run; `cache_counters` tells a hit from a compile). Only the batch's dimensions are dynamic: `dynamic=True`
would make every float attribute symbolic and Dynamo trace the model twice. The manifest name stays
`compile` for bundles already built; `NAME` and `STAGE` are where the two names meet.
"""
from __future__ import annotations

import contextlib
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
from typing import Any, Dict, Iterator, List, Tuple

import torch

from ..dtypes import torch_dtype
from ..manifest import Artifact
from ..model import ExplicitDtypeModel
from ..padding import Ranges
from .base import BuildContext, Built, Exported, Kind, LoadEnv, Outputs, Runner, Skip

log = logging.getLogger(__name__)

NAME = "compile"  # the manifest's kind and the artifacts' names; the stage and switch: STAGE
STAGE = "inductor_cache"

CACHE_FILE = "inductor_cache.bin"
INFO_FILE = "compile.json"
COMPILE_OPTIONS: Dict[str, Any] = {"dynamic": None, "fullgraph": True}


# Dynamo specialises a dimension of size 1, so a one-row call would compile a second graph; the runner
# pads such a call to MIN_ROWS rows instead, and one dynamic graph serves every request.
MIN_ROWS = 2


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


def pad_rows(batch: Tuple[torch.Tensor, ...], rows: int = MIN_ROWS) -> Tuple[torch.Tensor, ...]:
    """Repeat the last row until the batch has `rows` rows (outputs of the copies are dropped)."""
    n = batch[0].shape[0]
    if n >= rows:
        return batch
    return tuple(torch.cat([t, t[-1:].expand(rows - n, *t.shape[1:])], 0) for t in batch)


def compiled_module(model: torch.nn.Module, dtype: str, action_head_dtype: str, device: str):
    module = ExplicitDtypeModel(model, torch_dtype(dtype), torch_dtype(action_head_dtype),
                                torch.device(device).type).to(device)
    return module, torch.compile(module, **COMPILE_OPTIONS)


def _batch(rows: int, tokens: int, markers: int, device: str):
    g = torch.Generator().manual_seed(rows * 1000 + tokens)
    ids = torch.randint(5, 200, (rows, tokens), generator=g)
    mpos = torch.arange(1, markers + 1).repeat(rows, 1)
    return tuple(t.to(device) for t in (ids, torch.ones_like(ids), mpos, torch.ones((rows, markers), dtype=torch.bool),
                                        torch.zeros(rows, dtype=torch.long)))


def build_cache(agent, out_dir: Path, ranges: Ranges, dtype: str, action_head_dtype: str = "fp32",
                device: str = "cuda") -> Dict[str, Any]:
    """Compile for the warm shapes and write the cache artifacts; returns facts for the manifest."""
    torch._dynamo.reset()
    _, fn = compiled_module(agent.model, dtype, action_head_dtype, device)
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
    (out_dir / INFO_FILE).write_text(json.dumps({"options": COMPILE_OPTIONS, "dtype": dtype,
                                                 "action_head_dtype": action_head_dtype,
                                                 "shapes": list(timings), "compile_seconds": timings}, indent=1))
    return {"shapes": list(timings), "compile_seconds": timings, "bytes": len(data)}


class CompileRunner(Runner):
    """torch.compile of the explicit-dtype model, with the bundle's Inductor cache loaded first."""

    def __init__(self, art_dir: Path, model: torch.nn.Module, device: str = "cuda"):
        t0 = time.perf_counter()
        info = json.loads((Path(art_dir) / INFO_FILE).read_text(encoding="utf-8"))
        if info.get("options") != COMPILE_OPTIONS:  # its saved graphs would miss: a compile from scratch
            raise ValueError("it was compiled with options %r, this laya-aot compiles with %r: rebuild the bundle"
                             % (info.get("options"), COMPILE_OPTIONS))
        torch.compiler.load_cache_artifacts((Path(art_dir) / CACHE_FILE).read_bytes())
        self.device = torch.device(device)
        self._module, self._fn = compiled_module(model, info["dtype"], info["action_head_dtype"], device)
        self._lock = threading.Lock()
        self._first = True
        self.stats: Dict[str, object] = {"load_cache_artifacts_s": round(time.perf_counter() - t0, 3)}

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


def check_in_fresh_process(art_dir: Path, ckpt: Path, device: str, timeout_s: float = 900) -> Dict[str, Any]:
    """Load the saved cache as the runtime does, in a child with empty Inductor and Triton caches, and
    return what its first call cost (`CompileRunner.stats`: graphs, cache hits and misses, seconds).

    Why a child: the build process has compiled the graph already and may differ from a fresh one in
    state that enters the cache key (AOTInductor once changed an Inductor config value in place), so only
    a fresh process shows whether the runtime will hit the cache or compile from scratch."""
    with tempfile.TemporaryDirectory(prefix="laya-aot-cache-check-") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        p = subprocess.run([sys.executable, "-m", __name__, str(art_dir), str(ckpt), device],
                           capture_output=True, text=True, env=env, timeout=timeout_s)
    line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith(FRESH_MARK)), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError("a fresh process could not run the saved Inductor cache (exit %d): %s"
                           % (p.returncode, (p.stderr.strip().splitlines() or ["no output"])[-1]))
    stats = json.loads(line[len(FRESH_MARK):])
    misses = stats.get("first_call_fxgraph_cache_miss", 0) + stats.get("first_call_autograd_cache_miss", 0)
    if misses or stats.get("first_call_dynamo_graphs") != 1:
        raise RuntimeError("the saved Inductor cache did not serve a fresh process (graphs %s, FX-graph misses %s, "
                           "AOTAutograd misses %s): the runtime would compile from scratch"
                           % (stats.get("first_call_dynamo_graphs"), stats.get("first_call_fxgraph_cache_miss"),
                              stats.get("first_call_autograd_cache_miss")))
    return stats


def _fresh_process_main(art_dir: str, ckpt: str, device: str) -> None:
    from .. import laya_internals as laya_api

    # laya's module as the runtime's loader builds it for this kind (a thin agent given build_eager_module's)
    agent = laya_api.eager_agent(ckpt, device=device)
    runner = CompileRunner(Path(art_dir), agent.model, device)
    runner(*_batch(MIN_ROWS, 32, 2, device))
    print(FRESH_MARK + json.dumps(runner.stats), flush=True)


def build(ctx: BuildContext, exported: Exported) -> Built:
    """Compile on the build machine's GPU, save the cache, and keep it only if a fresh process hits it."""
    if ctx.device != "cuda":
        raise Skip("the compile route with a warm Inductor cache is built for CUDA targets; on the CPU the "
                   "AOTInductor package is the compiled artifact")
    if not torch.cuda.is_available():
        raise Skip("target %s needs its GPU on the build machine to compile and save Inductor caches"
                   % ctx.cfg.target.name)
    name = ctx.artifact_name(KIND)
    t0 = time.perf_counter()
    facts = build_cache(ctx.agent, ctx.staging / name, exported.ranges, ctx.dtype, ctx.cfg.export.action_head_dtype)
    seconds = time.perf_counter() - t0
    try:
        facts["fresh_process"] = check_in_fresh_process(ctx.staging / name, ctx.ckpt, ctx.device)
    except BaseException:
        shutil.rmtree(ctx.staging / name, ignore_errors=True)  # nothing of a cache that would not be used
        raise
    ctx.add_artifact(KIND, name, name, "cuda", ctx.dtype, seconds, details=facts)
    return Built("%d shapes, %.1f MB; a fresh process hit it (first call %.1f s)" % (
        len(facts["shapes"]), facts["bytes"] / 1e6, facts["fresh_process"].get("first_call_s", 0.0)))


def load(path: Path, art: Artifact, env: LoadEnv) -> Runner:
    return CompileRunner(path, env.model, env.device)


# not native: Python plus Triton kernels; a child probe would run its whole torch.compile a second time,
# so it is loaded in-process, where a failure is an exception the loader catches like any other
KIND = Kind(name=NAME, stage=STAGE, build=build, load=load, order=2, reverify=False, needs_module=True)


if __name__ == "__main__":
    _fresh_process_main(*sys.argv[1:4])

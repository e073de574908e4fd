"""The compile route with a pre-populated Inductor cache (CUDA targets).

At build time the explicit-dtype model is compiled with `torch.compile(dynamic=True)` on the shapes
the runtime pads to (laya's buckets: rows a power of two, tokens a multiple of 16), and the compiled
code is saved with `torch.compiler.save_cache_artifacts()`. At run time `CompileRunner` loads those
bytes with `torch.compiler.load_cache_artifacts()` before its first compile, so a fresh process
reuses the compiled graphs and kernels instead of running Inductor and Triton from scratch (Dynamo
still traces the model, which takes seconds, not minutes).
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

from ..padding import Ranges
from .export import ExplicitDtypeModel, torch_dtype

log = logging.getLogger(__name__)

CACHE_FILE = "inductor_cache.bin"
INFO_FILE = "compile.json"
COMPILE_OPTIONS: Dict[str, Any] = {"dynamic": True}


# Dynamo specialises a dimension of size 1, so a one-row call would compile a second graph; the runner
# pads such a call to MIN_ROWS rows instead, and one dynamic graph serves every request.
MIN_ROWS = 2


def warm_shapes(ranges: Ranges) -> List[Tuple[int, int]]:
    """(rows, tokens) run at build: one multi-row batch compiles the dynamic graph every request uses."""
    return [(max(MIN_ROWS, min(4, ranges.max_rows)), ranges.padded_tokens(min(ranges.max_tokens, 128)))]


def pad_rows(batch: Tuple[torch.Tensor, ...], rows: int = MIN_ROWS) -> Tuple[torch.Tensor, ...]:
    """Repeat the last row until the batch has `rows` rows (outputs of the copies are dropped)."""
    n = batch[0].shape[0]
    if n >= rows:
        return batch
    return tuple(torch.cat([t, t[-1:].expand(rows - n, *t.shape[1:])], 0) for t in batch)


def compiled_module(model: torch.nn.Module, dtype: str, action_head_dtype: str, device: str):
    module = ExplicitDtypeModel(model, torch_dtype(dtype), torch_dtype(action_head_dtype)).to(device)
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
    with torch.no_grad():
        for rows, tokens in warm_shapes(ranges):
            t0 = time.perf_counter()
            fn(*_batch(rows, tokens, 4, device))
            if device == "cuda":
                torch.cuda.synchronize()
            timings["%dx%d" % (rows, tokens)] = round(time.perf_counter() - t0, 3)
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

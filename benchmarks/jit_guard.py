"""Count, or forbid, every way this process could compile a TileLang kernel.

For proofs, not for serving (so not in the package): tests and the GPU benchmarks (`import jit_guard`, as they
import the harness) wrap the precompiled path in
`jit_guard(forbid=True)` and assert the counter stays at zero; wrapped around laya's own
`fast=True` path with `forbid=False` it counts what that path compiles.

Entry points covered (TileLang 0.1.15):
- `tilelang.jit.JITImpl.compile`: every `@tilelang.jit` factory miss (class-level; the
  bundle hook in driver.py sits on the instance and only reaches it when no bundle is active);
- `tilelang.jit.kernel.JITKernel._compile_and_create_adapter`: lowering + codegen for every
  execution backend, whatever route led there (tilelang.compile, par_compile, autotuner);
- `tilelang.contrib.nvcc.compile_cuda` and TVM's `tvm.contrib.nvcc.compile_cuda`: the nvcc calls.
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Iterator, List, Tuple

from laya_aot.errors import LayaAotError


class JITForbidden(LayaAotError, RuntimeError):
    """A TileLang/nvcc compile was attempted inside jit_guard(forbid=True)."""


def _targets() -> List[Tuple[object, str, str]]:
    import importlib

    import tilelang  # noqa: F401  (puts TileLang's bundled tvm on the path)
    from tilelang.jit import JITImpl  # `tilelang.jit` the attribute is the decorator, not the module
    from tilelang.jit.kernel import JITKernel

    tl_nvcc = importlib.import_module("tilelang.contrib.nvcc")
    out = [(JITImpl, "compile", "JITImpl.compile"),
           (JITKernel, "_compile_and_create_adapter", "JITKernel._compile_and_create_adapter"),
           (tl_nvcc, "compile_cuda", "tilelang.contrib.nvcc.compile_cuda")]
    try:
        tvm_nvcc = importlib.import_module("tvm.contrib.nvcc")
        out.append((tvm_nvcc, "compile_cuda", "tvm.contrib.nvcc.compile_cuda"))
    except ImportError:
        pass
    return out


@contextlib.contextmanager
def jit_guard(forbid: bool = True) -> Iterator[Counter]:
    """Patch the compile entry points; yields a Counter of attempts by entry point."""
    counts: Counter = Counter()
    lock = threading.Lock()
    saved = []

    def wrap(orig, label):
        def guarded(*args, **kwargs):
            with lock:
                counts[label] += 1
            if forbid:
                raise JITForbidden("%s called while TileLang compilation is forbidden" % label)
            return orig(*args, **kwargs)

        return guarded

    for owner, attr, label in _targets():
        orig = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        saved.append((owner, attr, orig))
        setattr(owner, attr, wrap(orig, label))
    try:
        yield counts
    finally:
        for owner, attr, orig in reversed(saved):
            setattr(owner, attr, orig)


__all__ = ["JITForbidden", "jit_guard"]

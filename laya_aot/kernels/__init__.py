"""Precompiled TileLang kernels for laya's fast path: catalogue, cross-compile, run without JIT.

    specs = catalogue(encoder_config, "bf16", max_len=1024, max_rows=64)     # what FastLaya can ask for
    report = compile_catalogue(specs, "sm_90a", Path("out/sm_90a"))          # nvcc, no GPU needed
    reports = build_for_checkpoint(ckpt, ["sm_80", "sm_90a"], "bf16", 1024, 64, Path("out"))
    fast = make_fast_forward(agent, Path("out"), "sm_90a", reports["sm_90a"]["kernels"])
    agent.model.forward = fast.forward                                        # or PrecompiledTileLangBackend

Only `catalogue` works without TileLang installed; the rest need the `tilelang` extra.
"""
from .catalogue import KernelSpec, catalogue, encoder_dims, row_buckets, shape_specs, static_lengths
from .cross_compile import DEFAULT_ARCHS, build_for_checkpoint, checkpoint_catalogue, compile_catalogue, find_nvcc
from .driver import (
                     BundleError,
                     KernelBundle,
                     KernelMissing,
                     PrecompiledFast,
                     PrecompiledTileLangBackend,
                     arch_of,
                     detect_arch,
                     make_fast_forward,
                     select_arch,
)

__all__ = ["DEFAULT_ARCHS", "BundleError", "KernelBundle", "KernelMissing", "KernelSpec", "PrecompiledFast",
           "PrecompiledTileLangBackend", "arch_of", "build_for_checkpoint", "catalogue", "checkpoint_catalogue",
           "compile_catalogue", "detect_arch", "encoder_dims", "find_nvcc", "make_fast_forward", "row_buckets",
           "select_arch", "shape_specs", "static_lengths"]

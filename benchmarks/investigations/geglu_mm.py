"""An investigation (session 21), not part of the package: ModernBERT's GeGLU input projection as one Triton
kernel, `gelu(x @ Wi[:I].T) * (x @ Wi[I:].T)` without the 2I-wide product in memory.

transformers' `ModernBertMLP` runs `Wi` (hidden -> 2 x intermediate), splits the product, and multiplies the
gelu of its first half by its second: on a GPU a cuBLAS GEMM that writes rows x 2I, then a pointwise kernel that
reads it back and writes rows x I. At 32 x 1024 tokens on the H200 (large-1024) that pointwise kernel is 4.2 ms of
a 61 ms forward (`benchmarks/results/gpu_h200_profile.md`, session 16). Here each program computes a tile of both
halves (two accumulators over the same rows of x) and applies the gelu and the product to the fp32 accumulators
before one store: the same maths, rounded once instead of three times.

Measured against cuBLAS + Inductor's pointwise kernel on the H200 (`geglu_mm_ab.py`,
`benchmarks/results/gpu_h200_geglu.md`): 1.05-1.45x slower at every shape tried, so the package does not use it.
`reference` is the same computation in plain torch.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

OP = "laya_aot_investigation::geglu_mm"


@triton.jit
def _kernel(X, W, B, OUT, M, N, K, sxm, swn, som,
            HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n  # grouped order: programs sharing W's tiles run together (L2 reuse)
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = X + offs_m[:, None] * sxm + offs_k[None, :]
    a_ptrs = W + offs_n[None, :] * swn + offs_k[:, None]  # a K x N tile of Wi[:I].T
    g_ptrs = a_ptrs + N * swn  # the same tile of Wi[I:].T
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            wa = tl.load(a_ptrs, mask=n_ok[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wa = tl.load(a_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_a = tl.dot(x, wa, acc_a)
        acc_g = tl.dot(x, wg, acc_g)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    if HAS_BIAS:
        acc_a += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.load(B + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = 0.5 * acc_a * (1.0 + tl.math.erf(acc_a * 0.7071067811865476)) * acc_g
    tl.store(OUT + offs_m[:, None] * som + offs_n[None, :], out.to(OUT.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


@triton_op(OP, mutates_args={})
def geglu_mm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x: ... x K (last dimension contiguous), weight: 2I x K (Wi's, contiguous), bias: 2I or None.
    Returns ... x I: gelu(x @ weight[:I].T + bias[:I]) * (x @ weight[I:].T + bias[I:]), exact (erf) gelu."""
    return _launch(x, weight, bias, None)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            cfg: Optional[dict]) -> torch.Tensor:
    """The op's launch; `cfg` (tiles and launch shape, CONFIG when None) is for benchmarks that try others."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    n = weight.shape[0] // 2
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = dict(cfg or CONFIG)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    wrap_triton(_kernel)[grid](
        x2, weight, bias if bias is not None else weight, out, m, n, k, x2.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % cfg["BLOCK_K"] == 0, **cfg)
    return out.reshape(*x.shape[:-1], n)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """`geglu_mm` in plain torch (transformers' ModernBertMLP up to Wo, with the exact gelu)."""
    a, g = F.linear(x, weight, bias).chunk(2, dim=-1)
    return F.gelu(a) * g

"""A split-K matrix product for the short calls' skinny GEMMs (M = rows x tokens small), as a Triton op.

At a short call's 64-128 tokens, cuBLAS reads each weight at about a third of the GPU's memory bandwidth (the
encoder's four GEMMs per layer set a 1x1 call's time): an output of M x N in 64 x 64 tiles is too few thread
blocks to keep every SM streaming weights. This op also splits K: each block multiplies one K slice, writes its
fp32 partial sum, and a second kernel adds the slices in a fixed order (deterministic). The split is chosen from
M so that about two blocks run per SM, and falls to one (no split) for large M.

A `torch.library.triton_op`: torch.export records it and AOTInductor compiles both kernels into the package,
like `laya_aot.modeling.window_attention`. `benchmarks/aoti_variants.py`'s `+splitk` puts it under the faithful
path's products (`laya_aot.modeling.gemm.linear`) to time whole forwards against cuBLAS's.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

BM, BN, BK = 64, 64, 64
SLICES_MAX = 8
BLOCKS_PER_SM = 2
REDUCE_BLOCK = 1024


@triton.jit
def _partial(x_ptr, w_ptr, p_ptr, M, N, K, k_per, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k0 = pid_s * k_per
    for k in range(k0, tl.minimum(k0 + k_per, K), BK):
        kk = k + rk
        x = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(p_ptr + pid_s * M * N + rm[:, None] * N + rn[None, :], acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _reduce(p_ptr, y_ptr, MN, S, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    ok = i < MN
    acc = tl.zeros((B,), dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(p_ptr + s * MN + i, mask=ok, other=0.0)
    tl.store(y_ptr + i, acc, mask=ok)


_SMS: Optional[int] = None


def _sms() -> int:
    global _SMS
    if _SMS is None:
        _SMS = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count \
            if torch.cuda.is_available() else 132
    return _SMS


@triton_op("laya_aot_bench::splitk_mm", mutates_args={})
def splitk_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M x K) @ w.T (w: N x K), both 16-bit and contiguous; fp32 out."""
    m, k = x.shape
    n = w.shape[0]
    tiles = triton.cdiv(n, BN) * triton.cdiv(m, BM)
    slices = torch.sym_max(1, torch.sym_min(SLICES_MAX, (BLOCKS_PER_SM * _sms()) // tiles))
    k_per = triton.cdiv(triton.cdiv(k, slices), BK) * BK
    used = triton.cdiv(k, k_per)
    part = torch.empty((used, m, n), device=x.device, dtype=torch.float32)
    wrap_triton(_partial)[(triton.cdiv(n, BN), used, triton.cdiv(m, BM))](
        x, w, part, m, n, k, k_per, BM=BM, BN=BN, BK=BK, num_warps=4, num_stages=3)
    y = torch.empty((m, n), device=x.device, dtype=torch.float32)
    wrap_triton(_reduce)[(triton.cdiv(m * n, REDUCE_BLOCK),)](part, y, m * n, used, B=REDUCE_BLOCK)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, name: str = "") -> torch.Tensor:
    """`laya_aot.modeling.gemm.linear` with the product by `splitk_mm` where it runs (CUDA, 16-bit weights)."""
    if not x.is_cuda or weight.dtype not in (torch.float16, torch.bfloat16):
        from laya_aot.modeling import gemm

        return gemm.__dict__["_stock_linear"](x, weight, bias, name)
    lead = x.shape[:-1]
    y = splitk_mm(x.reshape(-1, x.shape[-1]).to(weight.dtype).contiguous(), weight.contiguous())
    y = y.reshape(*lead, weight.shape[0])
    return y if bias is None else y + bias.float()


SKINNY_M = 256  # rows x tokens up to which `linear_cond` takes the split-K product


def linear_cond(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                name: str = "") -> torch.Tensor:
    """`linear` for products of at most SKINNY_M rows, cuBLAS's (as the faithful path computes it) above: one
    `torch.cond` per product, decided at run time from the call's shape."""
    from laya_aot.modeling import gemm

    stock = gemm.__dict__["_stock_linear"]
    if not x.is_cuda or weight.dtype not in (torch.float16, torch.bfloat16):
        return stock(x, weight, bias, name)
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1]).to(weight.dtype).contiguous()
    y = torch.cond(flat.shape[0] <= SKINNY_M,
                   lambda a, w: splitk_mm(a, w),
                   lambda a, w: torch.nn.functional.linear(a, w).float(),
                   (flat, weight.contiguous()))
    y = y.reshape(*lead, weight.shape[0])
    return y if bias is None else y + bias.float()


def install(choose: bool = False) -> None:
    """Put `linear` (`linear_cond` with `choose`) under the faithful path's products in this process (before the
    model is built)."""
    from laya_aot.modeling import gemm

    if "_stock_linear" not in gemm.__dict__:
        gemm._stock_linear = gemm.linear
    gemm.linear = linear_cond if choose else linear

"""One Triton kernel for ModernBERT's attention on a GPU: a key-padding mask and an optional window, no L x L mask.

The stock export hands SDPA dense rows x 1 x L x L masks, so cuDNN computes every score of every layer and a
kernel per layer rebuilds the mask: at 32 x 1024 tokens on the H200 that was 25 ms of a 74 ms forward
(benchmarks/results/calls.md). This kernel reads the rows x L padding mask directly and, in a
local layer, visits only the key blocks a query block's window reaches. Query i attends key j iff key j is a
token and, with a window w, |i - j| <= w. A query with no such key (a padded position beyond every window)
gets zeros; nothing reads those positions.

It is a `torch.library.triton_op`, so torch.export records one op and AOTInductor compiles the kernel into the
package (no Python at serving time). Only imported where triton is (a CUDA build); the same computation in
plain torch, the tests' yardstick, is `laya_aot.modeling.attention.reference`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

OP = "laya_aot::window_attention"
SEGMENT_OP = "laya_aot::segment_attention"
LOG2E = math.log2(math.e)


@triton.jit
def _kernel(Q, K, V, KEEP, LO, HI, OUT, qk_scale, L, H,
            sqb, sqh, sql, skb, skh, skl, svb, svh, svl, smb, sob, sol, soh,
            WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEGMENTS: tl.constexpr):
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor may pass the scale as an fp64 constant
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_j = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < L
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sql + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if WINDOW >= 0:
        lo = tl.maximum(start_m - WINDOW, 0)
        hi = tl.minimum(start_m + BLOCK_M + WINDOW, L)
    else:
        lo = 0
        hi = L
    if SEGMENTS:  # only the keys of the block's queries' segments: [first start, last end)
        seg_q = tl.load(KEEP + b * smb + offs_m, mask=m_ok, other=0)
        lo = tl.maximum(lo, tl.min(tl.load(LO + b * smb + offs_m, mask=m_ok, other=L), 0))
        hi = tl.minimum(hi, tl.max(tl.load(HI + b * smb + offs_m, mask=m_ok, other=0), 0))
    lo = (lo // BLOCK_N) * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_j
        n_ok = offs_n < L
        seg_k = tl.load(KEEP + b * smb + offs_n, mask=n_ok, other=0)
        k = tl.load(K + b * skb + h * skh + offs_n[None, :] * skl + offs_d[:, None],
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, k) * qk_scale
        allowed = (seg_k != 0)[None, :]
        if SEGMENTS:
            allowed = allowed & (seg_k[None, :] == seg_q[:, None])
        if WINDOW >= 0:
            dist = offs_m[:, None] - offs_n[None, :]
            allowed = allowed & (dist <= WINDOW) & (dist >= -WINDOW)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # no key yet: no NaN from -inf - -inf
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * svb + h * svh + offs_n[:, None] * svl + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(OUT + b * sob + offs_m[:, None] * sol + h * soh + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])


def blocks(head_dim: int, window: int) -> dict:
    """Tile sizes and launch shape (H200, head dim 64, 32 x 16 x 1024 in bf16: benchmarks/results/
    calls.md): 64-query blocks for a window (fewer keys outside it), 128 for a global layer."""
    if max(16, triton.next_power_of_2(head_dim)) > 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
    return dict(BLOCK_M=64 if window >= 0 else 128, BLOCK_N=64, num_warps=4, num_stages=3)


@triton_op(OP, mutates_args={})
def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, window: int,
                     scale: float) -> torch.Tensor:
    """q, k, v: rows x heads x L x D (last dimension contiguous), keep: rows x L (nonzero = a token);
    window < 0: none. Returns rows x L x heads x D, what transformers' attention interface returns."""
    return _launch(q, k, v, keep, window, scale)


@triton_op(SEGMENT_OP, mutates_args={})
def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: torch.Tensor, lo: torch.Tensor,
                      hi: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """`window_attention` over packed rows: seg (rows x L, int32) numbers each position's segment (0: padding), and
    query i attends key j iff both are in one segment (and within the window); lo and hi (rows x L, int32) are the
    first position of i's segment and the one past its last (padding: L and 0), so that a query block visits only
    the key blocks of its own segments. Rows x L x heads x D out; zeros at padding."""
    return _launch(q, k, v, seg, window, scale, bounds=(lo, hi))


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, window: int, scale: float,
            cfg: Optional[dict] = None, bounds: Optional[tuple] = None) -> torch.Tensor:
    """The ops' launch (`bounds`: segment_attention's lo and hi); `cfg` (tile sizes and launch shape, `blocks`' when
    None) is for benchmarks/attention_ab.py, which times the kernel with other tiles."""
    rows, heads, length, dim = q.shape
    out = torch.empty((rows, length, heads, dim), dtype=q.dtype, device=q.device)
    cfg = cfg or blocks(dim, window)
    lo, hi = bounds if bounds is not None else (keep, keep)

    def grid(meta):
        return (triton.cdiv(length, meta["BLOCK_M"]), rows * heads)

    wrap_triton(_kernel)[grid](
        q, k, v, keep, lo, hi, out, scale * LOG2E, length, heads,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), keep.stride(0), out.stride(0), out.stride(1), out.stride(2),
        WINDOW=window, HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), SEGMENTS=bounds is not None,
        **cfg)
    return out


"""`modeling.attention` and `modeling.window_attention`: the attention a GPU artifact is exported with computes
laya's attention.

The Triton kernel itself runs only on a GPU, where each artifact is verified against laya's fp32 forward at
build. Here (1) the switched encoder, whose attention on the CPU is `attention.reference`, is compared with laya's
own forward on fuzzed batches, which checks the window read from transformers, the padding mask and the layouts;
and (2) where triton is installed, the kernel is run in Triton's interpreter against `reference` on shapes and
head dimensions the demo checkpoints do not have (skipped, and reported as skipped, elsewhere).
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from laya_aot.modeling import attention
from laya_aot.modeling.model import ExplicitDtypeModel


def _model(ckpt):
    import laya

    return laya.load(str(ckpt), device="cpu").model.eval()


def _batch(rows: int, length: int, seed: int, empty_row: bool = False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 900, (rows, length), generator=g)
    att = torch.ones(rows, length, dtype=torch.long)
    for r in range(1, rows):  # every row but the first padded by a different amount, some far past a window
        att[r, int(torch.randint(1, length, (1,), generator=g)):] = 0
    if empty_row:
        att[-1] = 0
    markers = min(4, length)
    mpos = torch.stack([torch.randperm(int(att[r].sum().clamp(min=markers)), generator=g)[:markers]
                        for r in range(rows)])
    return ids, att, mpos, torch.ones(rows, markers, dtype=torch.bool), torch.arange(rows) % 3


def _diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


# fp32 sums in another order: logits of magnitude ~30 move by ~1e-5; a wrong window or mask moves them by > 1e-3
SAME = 1e-4


def _switched(model):
    copied = copy.deepcopy(model)
    assert attention._install(copied)
    return copied


@pytest.mark.parametrize("which", ["demo_ckpt", "alt_ckpt"])  # two window widths, head dims 16 and 32
def test_switched_model_equals_laya_on_fuzzed_batches(which, request):
    model = _model(request.getfixturevalue(which))
    switched = _switched(model)
    w = attention.band_halfwidth(model.encoder.config)
    for i, length in enumerate(sorted({16, 48, w, 2 * w + 16, 4 * w + 48})):
        for rows in (1, 3):
            args = _batch(rows, length, seed=10 * i + rows)
            with torch.no_grad():
                want, got = model(*args), switched(*args)
            assert _diff(want, got) < SAME, (which, rows, length, _diff(want, got))
    # a row of padding only gives finite outputs, and the other rows are untouched by it
    args = _batch(3, 4 * w, seed=99, empty_row=True)
    with torch.no_grad():
        want, got = model(*args), switched(*args)
    assert all(torch.isfinite(t).all() for t in got)
    assert _diff([t[:2] for t in want], [t[:2] for t in got]) < SAME


def test_a_narrower_window_or_an_ignored_padding_is_caught(demo_ckpt):
    """The comparison above can fail: one key less in the window, or the padding mask left out, answers
    differently."""
    model = _model(demo_ckpt)
    args = _batch(3, 4 * attention.band_halfwidth(model.encoder.config), seed=5)
    narrower = _switched(model)
    for m in narrower.modules():
        if getattr(m, "laya_aot_window", None) is not None:
            m.laya_aot_window -= 1
    with torch.no_grad():
        want = model(*args)
        assert _diff(want, narrower(*args)) > 1e-3
        switched = _switched(model)
        ignored = (args[0], torch.ones_like(args[1])) + args[2:]
        # the switched model reads the mask it is given: all ones answers differently from laya with padding
        assert _diff(want, switched(*ignored)) > 1e-3


def test_band_halfwidth_is_read_from_transformers_mask(demo_ckpt, alt_ckpt):
    # the demo presets' local_attention is 64 and 32: transformers lets |i - j| <= local_attention // 2 through
    assert attention.band_halfwidth(_model(demo_ckpt).encoder.config) == 32
    assert attention.band_halfwidth(_model(alt_ckpt).encoder.config) == 16
    assert attention.band_halfwidth(type("C", (), {"sliding_window": None})()) is None


def test_only_a_modernbert_on_sdpa_in_16_bits_on_a_gpu_is_switched(demo_ckpt):
    model = _model(demo_ckpt)
    assert attention.switch(copy.deepcopy(model), "cpu", torch.bfloat16, "triton") == "stock"
    assert attention.switch(copy.deepcopy(model), "cuda", torch.float32, "triton") == "stock"
    assert attention.switch(copy.deepcopy(model), "cuda", torch.bfloat16, "stock") == "stock"
    other = copy.deepcopy(model)
    other.encoder.config._attn_implementation = "eager"
    assert not attention._install(other)
    assert other.encoder.config._attn_implementation == "eager"
    assert not attention._install(torch.nn.Linear(2, 2))


def test_the_export_module_records_its_attention_and_laya_model_is_untouched(demo_ckpt):
    model = _model(demo_ckpt)
    # on the CPU every artifact keeps transformers' attention, whatever the config asks
    assert ExplicitDtypeModel(model, torch.bfloat16, torch.float32, "cpu", attention="triton").attention == "stock"
    assert ExplicitDtypeModel(model, torch.bfloat16, torch.float32, "cpu", attention="stock").attention == "stock"
    assert model.encoder.config._attn_implementation == "sdpa"   # laya's own module is never switched
    with pytest.raises(ValueError, match="export.attention"):
        ExplicitDtypeModel(model, torch.float32, torch.float32, attention="banded")
    with pytest.raises(ValueError, match="one of triton, stock"):  # the rotation in the kernel is not built
        ExplicitDtypeModel(model, torch.float32, torch.float32, attention="triton_rope")


HAVE_TRITON = importlib.util.find_spec("triton") is not None

CASES = [  # rows, heads, length, head dim, window (-1: global), dtype
    (2, 3, 80, 64, 8, "float16"),      # windows narrower than a block, padding at the end
    (3, 2, 96, 48, 16, "float32"),     # a head dimension that is not a power of two
    (2, 2, 144, 32, -1, "float16"),    # a global layer
    (1, 2, 272, 64, 64, "float16"),    # ModernBERT's window over several key blocks
    (2, 1, 208, 128, 64, "float16"),   # head dimension 128
]

# run in a child: Triton reads TRITON_INTERPRET when torch and triton are imported, before any test runs
INTERPRET = """
import json, sys, torch
from laya_aot.modeling import attention, window_attention
out = []
for rows, heads, length, dim, window, dtype in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(length + dim)
    q, k, v = (torch.randn(rows, heads, length, dim, generator=g).to(dtype) for _ in range(3))
    v = v.transpose(1, 2).contiguous().transpose(1, 2)  # strided like ModernBERT's value view of Wqkv
    keep = torch.ones(rows, length, dtype=torch.bool)
    keep[0, length - 37:] = False                        # queries past every window: no key at all
    if rows > 1:
        keep[1, :5] = False
    want = attention.reference(q, k, v, keep, None if window < 0 else window, dim ** -0.5).float()
    got = window_attention.window_attention(q, k, v, keep, window, dim ** -0.5)
    narrower = window_attention.window_attention(q, k, v, keep, window - 1, dim ** -0.5) if window > 0 else want
    # the small query tiles benchmarks/attention_ab.py times for short calls
    small = window_attention._launch(q, k, v, keep, window, dim ** -0.5,
                                     cfg=dict(BLOCK_M=16, BLOCK_N=64, num_warps=2, num_stages=3))
    out.append([list(got.shape), float((got.float() - want).abs().max()), float((narrower.float() - want).abs().max()),
                float((small.float() - want).abs().max())])
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (the CUDA build's kernel): nothing to interpret")
def test_kernel_in_triton_interpreter_equals_reference():
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", INTERPRET, json.dumps(CASES)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    for case, got in zip(CASES, json.loads(p.stdout)):
        rows, heads, length, dim, window, dtype = case
        shape, diff, narrower, small_diff = got
        assert shape == [rows, length, heads, dim]
        tol = 2e-3 if dtype == "float16" else 1e-5
        assert diff < tol, (case, diff)
        assert small_diff < tol, (case, small_diff)
        if window > 0:  # it can fail: a window one narrower is caught
            assert narrower > 10 * tol, (length, dim, window, narrower)

"""`laya_aot.attention`: the mask-free attention a GPU artifact is exported with computes laya's attention.

Flash attention itself runs only on a GPU (each GPU artifact is verified against laya's fp32 forward at build);
here the same formulation (the padding penalty in an extra head dimension, the window as flash attention
reads it) runs through the module's CPU stand-in for the kernel and is compared with laya's own forward.
"""
from __future__ import annotations

import copy

import pytest
import torch

from laya_aot import attention
from laya_aot.model import ExplicitDtypeModel


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
            assert _diff(want, got) < 1e-5, (which, rows, length, _diff(want, got))
    # a row of padding only gives finite outputs, and the other rows are untouched by it
    args = _batch(3, 4 * w, seed=99, empty_row=True)
    with torch.no_grad():
        want, got = model(*args), switched(*args)
    assert all(torch.isfinite(t).all() for t in got)
    assert _diff([t[:2] for t in want], [t[:2] for t in got]) < 1e-5


def test_a_narrower_window_or_an_ignored_padding_is_caught(demo_ckpt):
    """The comparison above can fail: one key less in the window, or the padding penalty left out, answers
    differently."""
    model = _model(demo_ckpt)
    args = _batch(3, 4 * attention.band_halfwidth(model.encoder.config), seed=5)
    narrower = _switched(model)
    for m in narrower.modules():
        if getattr(m, "laya_aot_window", None) is not None:
            m.laya_aot_window -= 1
    no_penalty = _switched(model)
    with torch.no_grad():
        want = model(*args)
        assert _diff(want, narrower(*args)) > 1e-3
        original = attention.BIG
        try:
            attention.BIG = 0.0
            assert _diff(want, no_penalty(*args)) > 1e-3
        finally:
            attention.BIG = original


def test_band_halfwidth_is_read_from_transformers_mask(demo_ckpt, alt_ckpt):
    # the demo presets' local_attention is 64 and 32: transformers lets |i - j| <= local_attention // 2 through
    assert attention.band_halfwidth(_model(demo_ckpt).encoder.config) == 32
    assert attention.band_halfwidth(_model(alt_ckpt).encoder.config) == 16
    assert attention.band_halfwidth(type("C", (), {"sliding_window": None})()) is None


def test_only_a_modernbert_on_sdpa_in_16_bits_on_a_gpu_is_switched(demo_ckpt):
    model = _model(demo_ckpt)
    assert not attention.switch(copy.deepcopy(model), "cpu", torch.bfloat16)
    assert not attention.switch(copy.deepcopy(model), "cuda", torch.float32)
    other = copy.deepcopy(model)
    other.encoder.config._attn_implementation = "eager"
    assert not attention.switch(other, "cuda", torch.bfloat16)
    assert other.encoder.config._attn_implementation == "eager"
    assert not attention.switch(torch.nn.Linear(2, 2), "cuda", torch.bfloat16)


def test_the_export_module_records_its_attention_and_laya_model_is_untouched(demo_ckpt):
    model = _model(demo_ckpt)
    # on the CPU every artifact keeps transformers' attention, whatever the config asks
    assert ExplicitDtypeModel(model, torch.bfloat16, torch.float32, "cpu", attention="flash").attention == "stock"
    assert ExplicitDtypeModel(model, torch.bfloat16, torch.float32, "cpu", attention="stock").attention == "stock"
    assert model.encoder.config._attn_implementation == "sdpa"   # laya's own module is never switched
    with pytest.raises(ValueError, match="export.attention"):
        ExplicitDtypeModel(model, torch.float32, torch.float32, attention="banded")

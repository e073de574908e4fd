"""`laya_aot.attention`: the banded attention an artifact is exported with computes laya's attention."""
from __future__ import annotations

import copy

import pytest
import torch

from laya_aot import attention
from laya_aot.model import ExplicitDtypeModel


def _model(ckpt):
    import laya

    return laya.load(str(ckpt), device="cpu").model.eval()


def _batch(rows: int, length: int, seed: int, pad_rows: bool = True, empty_row: bool = False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 900, (rows, length), generator=g)
    att = torch.ones(rows, length, dtype=torch.long)
    if pad_rows:  # every row but the first padded by a different amount, some far past a window
        for r in range(1, rows):
            att[r, int(torch.randint(1, length, (1,), generator=g)):] = 0
    if empty_row:
        att[-1] = 0
    markers = min(4, length)
    mpos = torch.stack([torch.randperm(int(att[r].sum().clamp(min=markers)), generator=g)[:markers]
                        for r in range(rows)])
    return ids, att, mpos, torch.ones(rows, markers, dtype=torch.bool), torch.arange(rows) % 3


def _diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("which", ["demo_ckpt", "alt_ckpt"])  # two window widths, head dims 16 and 32
def test_banded_equals_laya_attention_on_fuzzed_batches(which, request):
    model = _model(request.getfixturevalue(which))
    banded = copy.deepcopy(model)
    assert attention.banded(banded)
    w = attention.band_halfwidth(model.encoder.config)
    block = attention.block_size(w)
    lengths = sorted({16, 48, block - 16, block, block + 16, 2 * block, 3 * block + 48})
    for i, length in enumerate(lengths):
        for rows in (1, 3):
            args = _batch(rows, length, seed=10 * i + rows)
            with torch.no_grad():
                want, got = model(*args), banded(*args)
            assert _diff(want, got) < 1e-5, (which, rows, length, _diff(want, got))
            assert all(torch.isfinite(t).all() for t in got)
    # a row of padding only gives finite outputs, and the other rows are untouched by it
    args = _batch(3, 2 * block, seed=99, empty_row=True)
    with torch.no_grad():
        want, got = model(*args), banded(*args)
    assert all(torch.isfinite(t).all() for t in got)
    assert _diff([t[:2] for t in want], [t[:2] for t in got]) < 1e-5


def test_a_band_one_narrower_is_caught(demo_ckpt):
    """The comparison above can fail: the same model with the band one key narrower answers differently."""
    model = _model(demo_ckpt)
    banded = copy.deepcopy(model)
    attention.banded(banded)
    for m in banded.modules():
        if getattr(m, "laya_aot_band", None) is not None:
            m.laya_aot_band -= 1
    args = _batch(2, 4 * attention.block_size(attention.band_halfwidth(model.encoder.config)), seed=5)
    with torch.no_grad():
        assert _diff(model(*args), banded(*args)) > 1e-3


def test_band_halfwidth_is_read_from_transformers_mask(demo_ckpt, alt_ckpt):
    # the demo presets' local_attention is 64 and 32: transformers lets |i - j| <= local_attention // 2 through
    assert attention.band_halfwidth(_model(demo_ckpt).encoder.config) == 32
    assert attention.band_halfwidth(_model(alt_ckpt).encoder.config) == 16


def test_only_a_modernbert_on_sdpa_is_switched(demo_ckpt):
    model = _model(demo_ckpt)
    other = copy.deepcopy(model)
    other.encoder.config._attn_implementation = "eager"
    assert not attention.banded(other)
    assert other.encoder.config._attn_implementation == "eager"
    assert not attention.banded(torch.nn.Linear(2, 2))
    assert attention.band_halfwidth(type("C", (), {"sliding_window": None})()) is None


def test_export_model_choice_is_recorded_and_the_served_model_untouched(demo_ckpt):
    model = _model(demo_ckpt)
    assert ExplicitDtypeModel(model, torch.float32, torch.float32, attention="banded").attention == "banded"
    assert ExplicitDtypeModel(model, torch.float32, torch.float32, attention="stock").attention == "stock"
    assert model.encoder.config._attn_implementation == "sdpa"   # laya's own module is never switched
    with pytest.raises(ValueError, match="export.attention"):
        ExplicitDtypeModel(model, torch.float32, torch.float32, attention="flash")


@pytest.mark.slow
def test_exported_banded_program_takes_the_whole_token_range(demo_ckpt):
    """torch.export keeps the declared token range (no length specialised away by the blocks), and the program
    computes what the module does at the smallest, a middle and the largest length."""
    from laya_aot.kinds.exported_program import export_model, ranges_of

    module = ExplicitDtypeModel(_model(demo_ckpt), torch.float32, torch.float32, attention="banded")
    program = export_model(module, 4, 256, 8, 0, "cpu")
    r = ranges_of(program)
    assert (r.min_tokens, r.max_tokens) == (16, 256)
    run = program.module()
    for rows, length in ((1, 16), (3, 80), (4, 256)):
        args = _batch(rows, length, seed=length)
        with torch.no_grad():
            assert _diff(module(*args), run(*args)) < 1e-5

"""`laya_aot.head`: the head's last layer computed only at position 0 and the markers answers as laya's does.

The export copy must give laya's fp32 forward's answers on batches nobody chose for convenience: two demo
checkpoints of different widths, padded rows, masked markers (laya's -1 positions), repeated marker positions,
one marker. Its parameters keep laya's names (an AOTInductor package finds its weights in the checkpoint by name).
"""
from __future__ import annotations

import pytest
import torch

from laya_aot import head
from laya_aot.model import ExplicitDtypeModel


def _model(ckpt):
    import laya

    return laya.load(str(ckpt), device="cpu").model.eval()


def _batch(gen: torch.Generator, rows: int, tokens: int, markers: int):
    ids = torch.randint(5, 200, (rows, tokens), generator=gen)
    att = torch.ones(rows, tokens, dtype=torch.long)
    for r in range(rows):  # every row a different real length
        att[r, int(torch.randint(tokens // 2, tokens + 1, (1,), generator=gen)):] = 0
    real = int(att.sum(1).min())
    mpos = torch.randint(1, real, (rows, markers), generator=gen)
    mmask = torch.ones(rows, markers, dtype=torch.bool)
    if markers > 2:
        mpos[0, -1], mmask[0, -1] = -1, False  # a masked marker, as laya pads them
        mpos[-1, 1] = mpos[-1, 0]  # the same position twice
    return ids, att, mpos, mmask, torch.randint(0, 3, (rows,), generator=gen)


@pytest.mark.parametrize("which", ["demo_ckpt", "alt_ckpt"])
def test_answer_rows_give_lay_as_answers_in_fp32(which, request):
    model = _model(request.getfixturevalue(which))
    mine = ExplicitDtypeModel(model, torch.float32, torch.float32, head="answer_rows")
    assert mine.head == "answer_rows"
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for rows, tokens, markers in ((1, 32, 1), (3, 48, 2), (5, 64, 6), (2, 96, 9)):
            batch = _batch(gen, rows, tokens, markers)
            want = model(*batch)
            got = mine(*batch)
            for w, g in zip(want, got):
                assert g.shape == w.shape
                torch.testing.assert_close(g, w.float(), rtol=1e-5, atol=1e-5)


def test_parameter_names_stay_lay_as(demo_ckpt):
    model = _model(demo_ckpt)
    mine = ExplicitDtypeModel(model, torch.float32, torch.float32, head="answer_rows")
    assert ["model." + k for k in model.state_dict()] == list(mine.state_dict())
    assert type(model.head.layers[-1]) is torch.nn.TransformerEncoderLayer  # laya's own model is untouched


def test_wrong_rows_are_caught(demo_ckpt):
    """The comparison above can fail: rows without position 0 leave the action head's pooled row at zero."""
    model = _model(demo_ckpt)
    mine = ExplicitDtypeModel(model, torch.float32, torch.float32, head="answer_rows")
    batch = _batch(torch.Generator().manual_seed(3), 3, 48, 3)
    last = mine._answer_rows_layer[0]
    with torch.no_grad():
        last.answer_rows = batch[2].clamp(min=0)
        wrong = mine._forward(*batch)
        last.answer_rows = None
        want = model(*batch)
    assert not torch.allclose(wrong[1], want[1].float(), atol=1e-3)


def test_without_rows_the_layer_is_lay_as(demo_ckpt):
    model = _model(demo_ckpt)
    mine = ExplicitDtypeModel(model, torch.float32, torch.float32, head="answer_rows")
    batch = _batch(torch.Generator().manual_seed(5), 2, 32, 2)
    with torch.no_grad():
        assert mine._answer_rows_layer[0].answer_rows is None  # cleared after every call
        torch.testing.assert_close(mine._forward(*batch)[0], model(*batch)[0].float(), rtol=1e-6, atol=1e-6)


def test_a_head_laya_does_not_build_is_left_alone():
    layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    holder = torch.nn.Module()
    holder.head = torch.nn.Module()
    holder.head.layers = layers
    assert head.install(holder) is None and type(layers[0]) is torch.nn.Linear
    with pytest.raises(ValueError, match="export.head"):
        ExplicitDtypeModel(holder, torch.float32, torch.float32, head="half")

"""`laya_aot.modeling.rotary`: the export copy's rotary tables give what transformers' own rotary forward computes.

The tables are made by that forward, so on the CPU the copy's cos and sin must equal it exactly at every
position of the export; a wrong table (another frequency, another position) must be caught. Two demo checkpoints
with different head dims and rope thetas, and the whole export module against laya's forward on fuzzed batches.
"""
from __future__ import annotations

import copy

import pytest
import torch

from laya_aot.modeling import rotary
from laya_aot.modeling.model import ExplicitDtypeModel


def _model(ckpt):
    import laya

    return laya.load(str(ckpt), device="cpu").model.eval()


@pytest.mark.parametrize("which", ["demo_ckpt", "alt_ckpt"])
def test_tables_equal_transformers_rotary_forward(which, request):
    model = _model(request.getfixturevalue(which))
    rope = rotary.rotary_module(model)
    assert rope is not None and rotary.why_not(rope) is None
    copied = copy.deepcopy(model)
    assert rotary.tabulate(copied, 96)
    table = rotary.rotary_module(copied)
    assert table.forward.__func__ is rotary.table_forward   # the copy reads its tables...
    assert rope.forward.__func__ is not rotary.table_forward  # ...laya's own module is untouched
    assert len(rope.layer_types) >= 2  # global and local layers: a table each
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.zeros(2, 3, dtype=dtype)
        for length in (16, 96):
            pos = torch.arange(length)[None].expand(2, -1)
            for layer_type in rope.layer_types:
                want = rope(x, pos, layer_type)
                got = table(x, pos, layer_type)
                for w, g in zip(want, got):
                    assert g.dtype == w.dtype == dtype
                    assert torch.equal(g, w), (layer_type, length, dtype)


def test_a_table_of_another_frequency_is_caught(demo_ckpt):
    """The equality above can fail: a table made with the other layer type's frequencies differs."""
    model = _model(demo_ckpt)
    rope = rotary.rotary_module(model)
    copied = copy.deepcopy(model)
    assert rotary.tabulate(copied, 64)
    table = rotary.rotary_module(copied)
    a, b = rope.layer_types[:2]
    table.register_buffer(rotary.PREFIX + "cos_" + a, getattr(table, rotary.PREFIX + "cos_" + b).clone(),
                          persistent=False)
    pos = torch.arange(64)[None]
    x = torch.zeros(1)
    assert not torch.equal(table(x, pos, a)[0], rope(x, pos, a)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_module_with_tables_answers_like_without(demo_ckpt, dtype):
    model = _model(demo_ckpt)
    computed = ExplicitDtypeModel(model, dtype, torch.float32, "cpu")
    tabled = ExplicitDtypeModel(model, dtype, torch.float32, "cpu", rope_table=128)
    assert (computed.rotary, tabled.rotary) == ("computed", "table")
    g = torch.Generator().manual_seed(7)
    for rows, length in ((1, 16), (3, 80), (2, 128)):
        ids = torch.randint(5, 900, (rows, length), generator=g)
        att = torch.ones(rows, length, dtype=torch.long)
        att[1:, length // 2:] = 0
        mpos = torch.stack([torch.randperm(length // 2, generator=g)[:4] for _ in range(rows)])
        batch = (ids, att, mpos, torch.ones(rows, 4, dtype=torch.bool), torch.arange(rows) % 3)
        with torch.no_grad():
            want, got = computed(*batch), tabled(*batch)
        for w, o in zip(want, got):
            assert torch.equal(w, o), (rows, length, dtype)


def test_a_rotary_module_it_does_not_know_is_left_alone(demo_ckpt):
    model = _model(demo_ckpt)
    copied = copy.deepcopy(model)
    rope = rotary.rotary_module(copied)
    rope.rope_type = dict(rope.rope_type, **{rope.layer_types[0]: "dynamic"})
    assert "may update its frequencies" in rotary.why_not(rope)
    assert not rotary.tabulate(copied, 32)
    assert rope.forward.__func__ is not rotary.table_forward
    assert rotary.rotary_module(torch.nn.Linear(2, 2)) is None
    assert ExplicitDtypeModel(copied, torch.float32, torch.float32, rope_table=32).rotary == "computed"

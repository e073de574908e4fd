"""`laya_aot.modeling.head`: the head's last layer computed only at position 0 and the markers answers as laya's does.

The export copy must give laya's fp32 forward's answers on batches nobody chose for convenience: two demo
checkpoints of different widths, padded rows, masked markers (laya's -1 positions), repeated marker positions,
one marker. Its parameters keep laya's names (an AOTInductor package finds its weights in the checkpoint by name).
"""
from __future__ import annotations

import pytest
import torch

from laya_aot.modeling import head
from laya_aot.modeling.model import ExplicitDtypeModel


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


def _mha(embed: int, heads: int, seed: int, cls: type = torch.nn.MultiheadAttention) -> torch.nn.MultiheadAttention:
    torch.manual_seed(seed)
    attn = cls(embed, heads, dropout=0.1, batch_first=True).eval()
    with torch.no_grad():
        attn.in_proj_bias.normal_()  # PyTorch starts the biases at zero: a swapped bias would pass unseen
        attn.out_proj.bias.normal_()
    return attn


@pytest.mark.parametrize("laya_class", [False, True])
@pytest.mark.parametrize("embed,heads", [(16, 1), (48, 3), (64, 8)])
def test_batch_first_attention_is_multihead_attentions(embed, heads, laya_class):
    """`head.attention` against the module itself (PyTorch's, and laya's `_DynamicMultiheadAttention`, which its
    head layers hold): self-attention (one packed projection) and queries at other rows (answer rows), with laya's
    bool padding mask and the float one TransformerEncoderLayer makes."""
    from laya.common import _DynamicMultiheadAttention

    attn = _mha(embed, heads, seed=embed, cls=_DynamicMultiheadAttention if laya_class else torch.nn.MultiheadAttention)
    assert head.batch_first_ready(attn)
    gen = torch.Generator().manual_seed(heads)
    x = torch.randn(3, 20, embed, generator=gen)
    pad = torch.zeros(3, 20, dtype=torch.bool)
    pad[1, 13:], pad[2, 5:] = True, True
    fpad = torch.zeros(3, 20).masked_fill(pad, float("-inf"))
    q = torch.randn(3, 4, embed, generator=gen)
    with torch.no_grad():
        for mask in (pad, fpad, None):
            want = attn(x, x, x, key_padding_mask=mask, need_weights=False)[0]
            torch.testing.assert_close(head.attention(attn, x, x, mask), want, rtol=1e-5, atol=1e-5)
            want = attn(q, x, x, key_padding_mask=mask, need_weights=False)[0]
            torch.testing.assert_close(head.attention(attn, q, x, mask), want, rtol=1e-5, atol=1e-5)


def test_batch_first_attention_under_bf16_autocast():
    attn = _mha(64, 4, seed=1)
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(0))
    pad = torch.zeros(2, 24, dtype=torch.bool)
    pad[1, 9:] = True
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]
        got = head.attention(attn, x, x, pad)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)


def test_every_head_layer_computes_its_attention_batch_first(demo_ckpt):
    """The demo checkpoint has two head layers: the first becomes a BatchFirstLayer, the last an AnswerRowsLayer
    (the fp32 comparison with laya's forward above covers both); laya's own model keeps its classes."""
    model = _model(demo_ckpt)
    assert len(model.head.layers) >= 2
    mine = ExplicitDtypeModel(model, torch.float32, torch.float32, head="answer_rows")
    kinds = [type(layer) for layer in mine.model.head.layers]
    assert kinds[:-1] == [head.BatchFirstLayer] * (len(kinds) - 1) and kinds[-1] is head.AnswerRowsLayer
    assert {type(layer) for layer in model.head.layers} == {torch.nn.TransformerEncoderLayer}
    stock = ExplicitDtypeModel(model, torch.float32, torch.float32, head="full")
    assert {type(layer) for layer in stock.model.head.layers} == {torch.nn.TransformerEncoderLayer}


def test_unusual_attention_keeps_the_stock_block():
    attn = torch.nn.MultiheadAttention(16, 2, batch_first=True, add_bias_kv=True).eval()
    assert not head.batch_first_ready(attn)
    assert not head.batch_first_ready(torch.nn.MultiheadAttention(16, 2, batch_first=False).eval())
    assert not head.batch_first_ready(torch.nn.MultiheadAttention(16, 2, batch_first=True, kdim=8, vdim=8).eval())


def test_artifacts_are_traced_and_compiled_without_cudnn_attention(monkeypatch, tmp_path):
    """cuDNN's attention builds a plan at every new shape (tens of ms on an H100): the export and the AOTInductor
    compile both run where torch may not choose it, and the choice is put back afterwards."""
    from laya_aot.kinds import aoti, exported_program
    from laya_aot.modeling.head import attention_backends

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with attention_backends():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before

    seen = {}

    def export(*args, **kwargs):
        seen["export"] = torch.backends.cuda.cudnn_sdp_enabled()
        raise RuntimeError("stop here")

    def compile_and_package(*args, **kwargs):
        seen["compile"] = torch.backends.cuda.cudnn_sdp_enabled()
        raise RuntimeError("stop here")

    monkeypatch.setattr(torch.export, "export", export)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compile_and_package)
    monkeypatch.setattr(aoti, "constants_spec", lambda ep, keys: {"constants": {}, "extra": {}})
    with pytest.raises(RuntimeError, match="stop here"):
        exported_program.export_model(torch.nn.Identity(), 2, 32, 4, 0)
    with pytest.raises(RuntimeError, match="stop here"):
        aoti.package(object(), tmp_path, [])  # the program itself is never read
    assert seen == {"export": False, "compile": False}

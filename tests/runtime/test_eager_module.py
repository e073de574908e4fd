"""laya's eager module built for a thin agent (`laya_internals.build_eager_module`): bitwise the module `laya.load`
builds (classes, parameters, buffers persistent or not, dtypes, devices, flags, forward), on checkpoints of
several shapes and weight dtypes, with laya's strict load's errors."""
from __future__ import annotations

import json
import shutil
import warnings

import laya
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from laya_aot import laya_internals as laya_api
from laya_aot.demo import make_checkpoint, question_suite, state_text
from tests.questions import assert_same_answers


def _resaved(src, dst, convert):
    """A copy of checkpoint `src` whose model.safetensors holds `convert(tensor)` for every tensor."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: convert(k, v).contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def checkpoints(demo_ckpt, alt_ckpt, tmp_path_factory):
    """name -> checkpoint: laya's own saved format (fp16 weights, as `save_checkpoint` writes) in three shapes
    (head dims 16, 32 and 64), and the first re-saved with bf16, fp32 and mixed weights."""
    root = tmp_path_factory.mktemp("eager-module")
    wide = make_checkpoint(root / "hd64", "hd64-bf16-ctx1024", seed=5)
    return {
        "tiny-fp16": demo_ckpt, "tiny-alt-hd32-fp16": alt_ckpt, "hd64-bf16-ctx1024-fp16": wide,
        "tiny-bf16": _resaved(demo_ckpt, root / "bf16", lambda k, v: v.bfloat16()),
        "tiny-fp32": _resaved(demo_ckpt, root / "fp32", lambda k, v: v.float()),
        "tiny-mixed": _resaved(demo_ckpt, root / "mixed",
                               lambda k, v: (v.float(), v.bfloat16(), v)[len(k) % 3]),
    }


NAMES = ["tiny-fp16", "tiny-alt-hd32-fp16", "hd64-bf16-ctx1024-fp16", "tiny-bf16", "tiny-fp32", "tiny-mixed"]


def _laya_module(ckpt):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return laya.load(str(ckpt), device="cpu").model


def _fast_module(ckpt):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya_api.thin_agent(str(ckpt), device="cpu")
    assert laya_api.is_thin(agent)
    return laya_api.build_eager_module(agent, str(ckpt))


def assert_same_module(got, want):
    """Bitwise the same module: its tree of classes, every parameter and buffer (non-persistent ones included),
    which buffers persist, dtypes, devices, requires_grad, training flags and laya's compile setting."""
    assert [(n, type(m)) for n, m in got.named_modules()] == [(n, type(m)) for n, m in want.named_modules()]
    for (gn, gm), (_, wm) in zip(got.named_modules(), want.named_modules()):
        assert gm.training == wm.training, gn
        assert gm._non_persistent_buffers_set == wm._non_persistent_buffers_set, gn
    for kind in ("named_parameters", "named_buffers"):
        g, w = dict(getattr(got, kind)(remove_duplicate=False)), dict(getattr(want, kind)(remove_duplicate=False))
        assert g.keys() == w.keys() and g, kind
        for name in w:
            a, b = g[name], w[name]
            assert type(a) is type(b) and a.dtype == b.dtype and a.device == b.device, name
            assert a.shape == b.shape and a.stride() == b.stride() and a.requires_grad == b.requires_grad, name
            assert torch.equal(a, b), name
    gs, ws = got.state_dict(), want.state_dict()
    assert gs.keys() == ws.keys() and all(torch.equal(gs[k], ws[k]) and gs[k].dtype == ws[k].dtype for k in ws)
    assert got.encoder.config.reference_compile is False and want.encoder.config.reference_compile is False


def _batch(model, rows=3, tokens=37, markers=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    vocab = model.encoder.config.vocab_size
    ids = torch.randint(5, vocab, (rows, tokens), generator=g)
    att = torch.ones(rows, tokens, dtype=torch.long)
    att[1, tokens - 9:] = 0                     # a padded row
    ids[att == 0] = 0
    mpos = torch.stack([torch.randperm(tokens - 10, generator=g)[:markers] for _ in range(rows)])
    mmask = torch.ones(rows, markers, dtype=torch.bool)
    mmask[2, 2:] = False                        # a question with fewer options
    qtype = torch.tensor([0, 1, 2])[:rows]
    return ids, att, mpos, mmask, qtype


@pytest.mark.parametrize("name", NAMES)
def test_the_module_is_bitwise_laya_s_and_answers_identically(checkpoints, name):
    ckpt = checkpoints[name]
    want, got = _laya_module(ckpt), _fast_module(ckpt)
    assert_same_module(got, want)
    with torch.no_grad():
        for seed in (0, 1):
            batch = _batch(want, seed=seed)
            (gl, ga), (wl, wa) = got(*batch), want(*batch)
            assert torch.equal(gl, wl) and torch.equal(ga, wa)   # tolerance 0.0


def test_the_module_owns_its_memory(checkpoints, tmp_path):
    """None of its tensors stays backed by the checkpoint file's mapping (an fp32 file needs no conversion on the
    CPU): rewriting the file afterwards changes nothing in the module."""
    ckpt = shutil.copytree(checkpoints["tiny-fp32"], tmp_path / "ckpt")
    want, got = _laya_module(ckpt), _fast_module(ckpt)
    path = ckpt / "model.safetensors"
    with open(path, "r+b") as f:   # the same file (inode), every tensor's bytes overwritten in place
        n = int.from_bytes(f.read(8), "little")
        f.seek(8 + n)
        f.write(b"\x7f" * (path.stat().st_size - 8 - n))
    assert_same_module(got, want)


def _strict_load_error(ckpt):
    """The error laya's strict load raises for this checkpoint (`Agent.__init__`'s `load_state_dict`)."""
    with pytest.raises(RuntimeError) as e:
        _laya_style(ckpt)
    return str(e.value)


def _laya_style(ckpt):
    """The module as `Agent.__init__` makes it: laya's build, its strict copying load, placed and in eval mode."""
    from laya.common import build_model

    cfg = json.loads((ckpt / "rl_agent_config.json").read_text())
    model = build_model(cfg, encoder_dir=str(ckpt / "encoder"), pretrained=False)
    model.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=True)
    model.encoder.config.reference_compile = False
    return model.to("cpu").eval()


@pytest.mark.parametrize("damage", ["missing", "unexpected", "shape"])
def test_a_checkpoint_laya_s_strict_load_refuses_raises_its_error(demo_ckpt, tmp_path, damage):
    def convert(k, v):
        return v[:-1] if damage == "shape" and k == "act_head.2.weight" else v
    ckpt = _resaved(demo_ckpt, tmp_path / "ckpt", convert)
    tensors = load_file(str(ckpt / "model.safetensors"))
    if damage == "missing":
        del tensors["scorer.3.bias"]
    elif damage == "unexpected":
        tensors["scorer.9.weight"] = torch.zeros(2, 2, dtype=torch.float16)
    save_file(tensors, str(ckpt / "model.safetensors"))
    want = _strict_load_error(ckpt)
    assert {"missing": "Missing key(s)", "unexpected": "Unexpected key(s)", "shape": "size mismatch"}[damage] in want
    with pytest.raises(RuntimeError) as e:
        _fast_module(ckpt)
    assert str(e.value) == want


def test_tied_parameters_stay_one_parameter_holding_the_value_laya_s_load_leaves(demo_ckpt, monkeypatch):
    """laya 0.4's DecisionModel ties nothing; a module that does keeps the tie, with the value a copying strict
    load leaves (the name loaded last)."""
    import laya.agent  # noqa: F401 - imported before the patch: its own `build_model` binding stays laya's
    import laya.common

    real = laya.common.build_model

    def tied(*a, **k):
        model = real(*a, **k)
        model.scorer[1].weight = model.head.layers[0].self_attn.out_proj.weight   # both (d, d)
        return model
    monkeypatch.setattr(laya.common, "build_model", tied)
    got, want = _fast_module(demo_ckpt), _laya_style(demo_ckpt)
    assert want.scorer[1].weight is want.head.layers[0].self_attn.out_proj.weight
    assert got.scorer[1].weight is got.head.layers[0].self_attn.out_proj.weight
    assert_same_module(got, want)
    file = load_file(str(demo_ckpt / "model.safetensors"))
    assert not torch.equal(file["scorer.1.weight"], file["head.layers.0.self_attn.out_proj.weight"])
    assert torch.equal(got.scorer[1].weight, file["scorer.1.weight"].float())   # loaded after the head's


def test_eager_agent_is_laya_load_s_agent_with_the_fast_module(alt_ckpt):
    """What the TileLang probe child and the compile route's fresh-process check load instead of `laya.load`."""

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, got = laya.load(str(alt_ckpt), device="cpu"), laya_api.eager_agent(str(alt_ckpt), device="cpu")
    assert not laya_api.is_thin(got) and got.backend == want.backend == "eager"
    assert (got.device, got.dtype, got.amp_enabled, got.cfg) == (want.device, want.dtype, want.amp_enabled, want.cfg)
    assert_same_module(got.model, want.model)
    states = [state_text(np.random.default_rng(3), n) for n in (10, 60)]
    for g, w in zip(got.predict_batch(states, question_suite()), want.predict_batch(states, question_suite())):
        assert_same_answers(g["answers"], w["answers"], tol=0.0)

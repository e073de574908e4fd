"""laya-aot's one seam into laya's internals: present in this laya, and a rename is caught by name.

Runs without the tilelang extra too (CI's serve environment): the TileLang route's names are checked where
tilelang is installed, and a missing optional package is reported as the extra to install."""
from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from laya_aot import laya_internals


def _routes_here():
    """Every route whose optional packages this environment has: core always, serve and tilelang per extra."""
    return tuple(r for r in laya_internals.ROUTES if not laya_internals.missing_packages(r))


def test_this_laya_has_everything_laya_aot_uses(demo_ckpt):
    import laya

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya.load(str(demo_ckpt), device="cpu")
    missing = laya_internals.check(agent, routes=_routes_here())
    assert not missing, ("this laya lacks %s, which laya-aot relies on (laya_aot/laya_internals/): adapt that "
                         "module to the new laya, or pin laya to a version that has them" % ", ".join(missing))


def test_every_name_belongs_to_one_route():
    names = [n for route in laya_internals.ROUTES.values() for n in route]
    assert len(names) == len(set(names)) and set(names) == set(laya_internals.MODULE_NAMES)


def test_this_laya_has_the_serve_route():
    pytest.importorskip("fastapi", reason="the serve route needs laya-aot[serve]")
    assert laya_internals.check(routes=("core", "serve")) == []


def test_this_laya_has_the_tilelang_route():
    pytest.importorskip("tilelang", reason="the TileLang route needs laya-aot[tilelang]")
    assert laya_internals.check(routes=("tilelang",)) == []


def test_a_missing_optional_package_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tilelang" else real(name, *a))
    with pytest.raises(laya_internals.RouteUnavailable) as e:
        laya_internals.require("core", "serve", "tilelang")
    assert str(e.value) == ('TileLang (its kernels and artifacts) needs tilelang, which is not installed: '
                            'pip install "laya-aot[tilelang]"')
    assert laya_internals.check(routes=("tilelang",)) == []  # the extra is the finding, not laya.fast's names
    from laya_aot import kinds

    tilelang_kind = next(k for k in kinds.REGISTRY if k.stage == "tilelang")
    assert tilelang_kind.refuse_device("cuda") == str(e.value)  # a GPU agent refuses its artifacts before a probe
    assert tilelang_kind.refuse_device("cpu") is None           # on a CPU, the device mismatch says it


def test_the_serve_path_imports_no_tilelang():
    """laya's TileLang modules (laya.fast, laya.tl_kernels) import tilelang: nothing that serves may import them
    until a TileLang artifact loads. A child with tilelang made unimportable imports what `laya-aot serve` and
    `laya_aot.load` import."""
    code = ("import sys; sys.modules['tilelang'] = None\n"
            "import laya_aot.serve, laya_aot.runtime.loader, laya_aot.kinds, laya_aot.cli, laya_aot.probe\n"
            "import laya_aot.kernels  # the TileLang driver itself imports tilelang only when kernels load\n"
            "from laya_aot import laya_internals as li\n"
            "li.require('core'); assert li.check(routes=('core',)) == [], li.check(routes=('core',))\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'tilelang' and sys.modules[m] is not None\n"
            "             or m in ('laya.fast', 'laya.tl_kernels'))\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_a_renamed_internal_is_named(monkeypatch, demo_ckpt):
    import laya
    from laya.agent import Agent

    monkeypatch.delattr(Agent, "deaccelerate")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya.load(str(demo_ckpt), device="cpu")
    monkeypatch.delattr(agent, "_gate")
    monkeypatch.delattr(Agent, "_gate")  # laya also keeps a class-level default
    assert laya_internals.check(agent) == ["laya.agent.Agent.deaccelerate", "Agent._gate"]


@pytest.mark.parametrize("amp, dtype, expect", [(False, None, "fp32"), (True, "bfloat16", "bf16"),
                                                (True, "float16", "fp16")])
def test_serving_dtype_follows_the_agents_autocast(amp, dtype, expect):
    import torch

    class _Agent:
        amp_enabled = amp

    a = _Agent()
    a.dtype = getattr(torch, dtype) if dtype else torch.float32
    assert laya_internals.serving_dtype(a) == expect


def test_serve_without_its_extra_is_one_line_naming_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("fastapi", "uvicorn") else real(name, *a))
    with pytest.raises(laya_internals.RouteUnavailable) as e:
        laya_internals.require("serve")
    assert str(e.value) == ('laya-aot serve needs fastapi, uvicorn, which are not installed: '
                            'pip install "laya-aot[serve]"')


def test_the_thin_agents_tokenizer_is_the_one_autotokenizer_gives(demo_ckpt, tmp_path, monkeypatch):
    """The first thin agent on a machine loads the class AutoTokenizer resolves to directly (AutoTokenizer's
    import costs seconds), a later one the snapshot of it (laya_aot.tokenizer_snapshot, no transformers import):
    both the same settings and the same ids on fuzzed text pairs, truncated and padded, as laya's own."""
    import random

    from transformers import AutoTokenizer

    from laya_aot import tokenizer_snapshot

    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer_snapshot, "_LOADED", {})
    laya = AutoTokenizer.from_pretrained(str(demo_ckpt / "tokenizer"))
    first = laya_internals.thin_agent(str(demo_ckpt), device="cpu").tok
    later = laya_internals.thin_agent(str(demo_ckpt), device="cpu").tok
    assert type(first) is type(laya) and type(later) is tokenizer_snapshot.SnapshotTokenizer
    for ours in (first, later):
        for attr in ("model_max_length", "padding_side", "truncation_side", "special_tokens_map", "pad_token_id"):
            assert getattr(ours, attr) == getattr(laya, attr), attr
        rng = random.Random(0)
        alphabet = "abcdefghij klmnop QRSTUV 0123 .,!?'\"-\n\té漢字🙂[CLS][SEP][PAD][MASK]"
        for _ in range(300):
            a = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))
            b = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
            for kw in ({"truncation": True, "max_length": 64}, {"padding": "max_length", "max_length": 96,
                                                                 "truncation": True}):
                assert ours(a, b, **kw)["input_ids"] == laya(a, b, **kw)["input_ids"]
            assert ours([a, b], padding=True)["attention_mask"] == laya([a, b], padding=True)["attention_mask"]
            assert ours(a, add_special_tokens=False) == dict(laya(a, add_special_tokens=False))


def test_a_tokenizer_of_another_class_goes_through_laya(demo_ckpt, tmp_path):
    """Only the fast tokenizers class is loaded directly; any other `tokenizer_class` is laya's own path."""
    import json
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(demo_ckpt, ckpt)
    cfg_path = ckpt / "tokenizer" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "BertTokenizerFast"
    cfg_path.write_text(json.dumps(cfg))
    assert laya_internals._fast_tokenizer(str(ckpt / "tokenizer")) is None
    from transformers import AutoTokenizer

    agent = laya_internals.thin_agent(str(ckpt), device="cpu")
    assert type(agent.tok) is type(AutoTokenizer.from_pretrained(str(ckpt / "tokenizer")))
    assert type(agent.tok).__name__.startswith("BertTokenizer")  # not the class the direct load makes


def test_a_thin_start_does_not_import_autotokenizer(demo_ckpt):
    """What the direct load saves: transformers' auto classes (and through them its modelling code) stay out."""
    code = ("import sys, laya_aot.laya_internals as li; a = li.thin_agent(%r, device='cpu'); "
            "print(sorted(m for m in ('transformers.models.auto.tokenization_auto', 'transformers.modeling_utils') "
            "if m in sys.modules))" % str(demo_ckpt))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout

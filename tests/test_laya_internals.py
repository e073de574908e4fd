"""laya-aot's one seam into laya's internals: present in this laya, and a rename is caught by name."""
from __future__ import annotations

import warnings

import pytest

from laya_aot import laya_internals


def test_this_laya_has_everything_laya_aot_uses(demo_ckpt):
    import laya

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya.load(str(demo_ckpt), device="cpu")
    missing = laya_internals.check(agent)
    assert not missing, ("this laya lacks %s, which laya-aot relies on (laya_aot/laya_internals.py): adapt that "
                         "module to the new laya, or pin laya to a version that has them" % ", ".join(missing))


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

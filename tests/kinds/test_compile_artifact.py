"""The compile artifact (saved Inductor cache) end to end on the CPU: what CI can check of a CUDA route.

The build stage only runs for CUDA targets, so this drives its two halves directly on the CPU:
`build_cache` compiles one dynamic graph and saves the cache artifacts; `CompileRunner` loads them in a
reset Dynamo and must answer like eager for every verification case, including one-row requests,
which it pads to two rows so that the saved graph (not a size-1 specialisation) serves them.
"""
from __future__ import annotations

import json

import pytest
import torch

from laya_aot.kinds.inductor_cache import (
    CACHE_FILE,
    INFO_FILE,
    MIN_ROWS,
    build_cache,
    check_in_fresh_process,
    pad_rows,
    warm_shapes,
)
from laya_aot.padding import Ranges
from laya_aot.tolerance import Rule
from laya_aot.verification import cases, verify_runner


def test_pad_rows_repeats_the_last_row_only_when_needed():
    batch = (torch.arange(6).view(1, 6), torch.ones(1, 6, dtype=torch.long), torch.tensor([[1, 2]]),
             torch.ones(1, 2, dtype=torch.bool), torch.tensor([2]))
    padded = pad_rows(batch)
    assert [t.shape[0] for t in padded] == [MIN_ROWS] * 5
    assert all(torch.equal(p[0], p[1]) and torch.equal(p[:1], b) for p, b in zip(padded, batch))
    two = tuple(torch.cat([t, t]) for t in batch)
    assert pad_rows(two) is two


def test_one_warm_shape_with_more_than_one_row():
    ((rows, tokens),) = warm_shapes(Ranges(1, 64, 16, 1024, 2, 64))
    assert rows >= MIN_ROWS and tokens % 16 == 0
    ((rows, _),) = warm_shapes(Ranges(1, 1, 16, 256, 2, 8))
    assert rows == MIN_ROWS  # even when the export allows one row


@pytest.fixture(scope="module")
def even_head_ckpt(tmp_path_factory):
    """A tiny checkpoint whose decision head has 2 attention heads: an even count, so under no_grad
    nn.TransformerEncoderLayer would take its fused path, as a ModernBERT-large-sized head (16) does."""
    from laya_aot.demo import DemoShape, make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "even", DemoShape(hidden_size=128), seed=1)


_FUSED = torch._transformer_encoder_layer_fwd


def _untraceable(*args, **kwargs):
    """The fused op as torch 2.11 has it: eager runs it, Dynamo cannot trace it."""
    if torch.compiler.is_compiling():
        raise RuntimeError("the fused encoder-layer op, which torch 2.11's Dynamo cannot trace")
    return _FUSED(*args, **kwargs)


@pytest.mark.slow  # compiles with Inductor, and again in a fresh process
def test_saved_cache_serves_a_fresh_dynamo_like_eager(even_head_ckpt, tmp_path, monkeypatch):
    import laya

    from laya_aot.kinds.inductor_cache import CompileRunner

    agent = laya.load(str(even_head_ckpt), device="cpu")
    assert agent.model.head.layers[0].self_attn.num_heads % 2 == 0
    # stand in for torch 2.11, whose Dynamo cannot trace the fused op (a graph break on the H200, run 8):
    # the build and the runner must not reach it; a plain full-graph compile does, which shows the
    # stand-in is in the way
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", _untraceable)
    plain = torch.compile(agent.model.float().eval(), backend="eager", fullgraph=True)
    with torch.no_grad(), pytest.raises(Exception, match="fused encoder-layer"):
        plain(*cases(3, Ranges(1, 8, 16, 256, 2, 64), 100, 0)[0].batch)
    torch._dynamo.reset()
    ranges = Ranges(1, 8, 16, int(agent.cfg.get("max_len", 256)), 2, 64)
    facts = build_cache(agent, tmp_path / "compile", ranges, "fp32", "fp32", device="cpu")
    assert facts["bytes"] > 0 and (tmp_path / "compile" / CACHE_FILE).stat().st_size == facts["bytes"]
    assert json.loads((tmp_path / "compile" / INFO_FILE).read_text())["shapes"] == facts["shapes"]
    torch._dynamo.reset()
    runner = CompileRunner(tmp_path / "compile", agent.model.float().eval(), device="cpu")
    pad = int(agent.tok.pad_token_id or 0)
    vocab = min(int(agent.model.encoder.config.vocab_size), len(agent.tok))
    res = verify_runner(runner, agent.model.float().eval(), cases(3, ranges, vocab, pad), ranges, pad,
                        torch.device("cpu"), Rule(1e-4, 1.0, "fp32"))
    assert res.passed, res.reason
    assert res.cases["one_row"]["rows"] == 1
    # every case (one row, one option, odd lengths, padded rows) ran on the one graph the first call
    # traced, and that call took Inductor's output from the cache instead of compiling it
    first = {k: v for k, v in runner.stats.items() if k.startswith("first_call_") and k != "first_call_s"}
    assert first == {"first_call_dynamo_graphs": 1, "first_call_fxgraph_cache_hit": 1,
                     "first_call_fxgraph_cache_miss": 0, "first_call_autograd_cache_hit": 1,
                     "first_call_autograd_cache_miss": 0}, first
    # what the build checks before it ships the artifact: a fresh process with empty caches hits it
    fresh = check_in_fresh_process(tmp_path / "compile", even_head_ckpt, "cpu")
    assert fresh["first_call_fxgraph_cache_hit"] == 1 and fresh["first_call_fxgraph_cache_miss"] == 0
    # laya's agent calls the forward under bf16 autocast on CUDA: that must not compile a second graph
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    case = cases(3, ranges, vocab, pad)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        runner(*case.batch)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_cache_compiled_with_other_options_is_refused(demo_ckpt, tmp_path):
    import laya

    from laya_aot.kinds.inductor_cache import CompileRunner

    art = tmp_path / "compile"
    art.mkdir()
    info = {"options": {"dynamic": True}, "dtype": "fp32", "action_head_dtype": "fp32"}
    (art / INFO_FILE).write_text(json.dumps(info))
    (art / CACHE_FILE).write_bytes(b"")
    agent = laya.load(str(demo_ckpt), device="cpu")
    try:
        CompileRunner(art, agent.model, device="cpu")
    except ValueError as e:
        assert "rebuild the bundle" in str(e) and "'dynamic': True" in str(e)
    else:
        raise AssertionError("a cache compiled with other options was loaded")



@pytest.mark.slow  # compiles with Inductor, and again in a fresh process
def test_a_cache_saved_under_other_inductor_config_fails_the_fresh_process_check(demo_ckpt, tmp_path):
    # what AOTInductor packaging did to the build process (aot_inductor.metadata filled in place): the
    # saved graphs carry a key no fresh process computes, so the runtime would compile from scratch
    import laya

    agent = laya.load(str(demo_ckpt), device="cpu")
    with torch._inductor.config.patch({"aot_inductor.metadata": {"AOTI_DEVICE_KEY": "cpu"}}):
        build_cache(agent, tmp_path / "compile", Ranges(1, 8, 16, 256, 2, 64), "fp32", "fp32", device="cpu")
    with pytest.raises(RuntimeError, match="did not serve a fresh process"):
        check_in_fresh_process(tmp_path / "compile", demo_ckpt, "cpu")

"""The compile artifact (saved Inductor cache) end to end on the CPU: what CI can check of a CUDA route.

The build stage only runs for CUDA targets, so this drives its two halves directly on the CPU:
`build_cache` compiles one dynamic graph and saves the cache artifacts; `CompileRunner` loads them in a
reset Dynamo and must answer like eager for every verification case, including one-row requests,
which it pads to two rows so that the saved graph (not a size-1 specialisation) serves them.
"""
from __future__ import annotations

import json

import torch

from laya_aot.build.inductor_cache import CACHE_FILE, INFO_FILE, MIN_ROWS, build_cache, pad_rows, warm_shapes
from laya_aot.build.verify import cases, verify_runner
from laya_aot.padding import Ranges


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


def test_saved_cache_serves_a_fresh_dynamo_like_eager(demo_ckpt, tmp_path):
    import laya

    from laya_aot.runtime.runners import CompileRunner

    agent = laya.load(str(demo_ckpt), device="cpu")
    ranges = Ranges(1, 8, 16, int(agent.cfg.get("max_len", 256)), 2, 64)
    facts = build_cache(agent, tmp_path / "compile", ranges, "fp32", "fp32", device="cpu")
    assert facts["bytes"] > 0 and (tmp_path / "compile" / CACHE_FILE).stat().st_size == facts["bytes"]
    assert json.loads((tmp_path / "compile" / INFO_FILE).read_text())["shapes"] == facts["shapes"]
    torch._dynamo.reset()
    runner = CompileRunner(tmp_path / "compile", agent.model.float().eval(), device="cpu")
    pad = int(agent.tok.pad_token_id or 0)
    vocab = min(int(agent.model.encoder.config.vocab_size), len(agent.tok))
    res = verify_runner(runner, agent.model.float().eval(), cases(3, ranges, vocab, pad), ranges, pad,
                        torch.device("cpu"), 1e-4, 1.0)
    assert res["passed"], res["reason"]
    assert res["cases"]["one_row"]["rows"] == 1
    # laya's agent calls the forward under bf16 autocast on CUDA: that must not compile a second graph
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    case = cases(3, ranges, vocab, pad)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        runner(*case.batch)
    assert counters["stats"]["unique_graphs"] == graphs

"""Checkpoints laya-aot's defaults were never tuned on: each builds, serves from a bundle artifact, and
answers 60 typed questions like laya eager.

The configurations spread over what users have: amp_dtype bf16 / fp16 / absent, head dims 16-64,
1-16 encoder heads, 1-3 decision-head layers, 2-8 actions, contexts 128-2048, several local-attention
windows, BPE and WordPiece tokenizers, decisive answers (large head weights), and a tokenizer config as
laya's trainer leaves it (rewritten by laya.load on first use). All are written by laya's own
save_checkpoint (fp16 weights on disk). The CPU serves fp32, so the answers must match eager to 1e-4.

Each configuration is exported (the step that meets its shapes: dynamic tokens, windows, heads, contexts) and
served by one CPU artifact kind, AOTInductor or ONNX (`KIND`), three configurations each, between them every
property above: what a kind lowers is the same exported program on every configuration, and both kinds are
tested on every other bundle of the suite. Building both kinds for all six took 304 of the suite's ~1,350
CPU-seconds on the 2-core machine, the largest share (issue 23's full suite under 10 minutes).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from laya_aot.demo import MATRIX
from tests.conftest import FEW_DECISIONS, build_bundle
from tests.questions import assert_same_answers, question_suite, state_text

# which artifact kind serves each configuration (module docstring): AOTInductor gets one head, sixteen heads and
# the longest context; ONNX head dim 64 and the decisive checkpoint
KIND = {"hd16-1head-ctx128": "aoti", "hd16-16heads-fp16": "aoti", "hd32-8actions-ctx2048": "aoti",
        "hd32-absent-decisive": "onnx", "hd64-bf16-ctx1024": "onnx", "hd16-8heads-fp16-ctx384": "onnx"}


@pytest.fixture(scope="module")
def eager_and_bundle(tmp_path_factory):
    """Built lazily per configuration, shared by the tests of that configuration."""
    made = {}

    def get(name):
        if name not in made:
            import laya

            from laya_aot.demo import make_checkpoint

            root = tmp_path_factory.mktemp(name)
            ckpt = make_checkpoint(root / "ckpt", name, seed=7)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                only = ["stages.onnx=false", "aoti.cpu_frozen=false"] if KIND[name] == "aoti" else ["stages.aoti=false"]
                # serving, not the decision statement (tests/numerics/test_precision.py): conftest.FEW_DECISIONS
                build_bundle(ckpt, root / "bundle", *FEW_DECISIONS, *only)
                made[name] = (ckpt, root / "bundle", laya.load(str(ckpt), device="cpu"))
        return made[name]

    return get


@pytest.mark.parametrize("name", list(MATRIX))
def test_matrix_checkpoint_serves_from_the_bundle_like_eager(name, eager_and_bundle):
    import laya_aot

    ckpt, bundle, eager = eager_and_bundle(name)
    rng = np.random.default_rng(len(name))
    states = [state_text(rng, n) for n in (4, 30, 200)]
    qs = question_suite()
    want = eager.predict_batch(states, qs)  # laya eager's answers, once: both artifacts are compared with them
    agent = laya_aot.load(str(ckpt), bundle=str(bundle), device="cpu", prefer=KIND[name], strict=True)
    assert agent.backend == "aot:%s" % KIND[name]
    got = agent.predict_batch(states, qs)
    assert len(got) == len(want) == len(states)
    for g, ref in zip(got, want):
        assert_same_answers(g["answers"], ref["answers"])
    assert agent.backend_object.stats.get("artifact_calls", 0) > 0


def test_the_matrix_covers_what_the_issue_asks():
    shapes = list(MATRIX.values())
    assert {s.amp_dtype for s in shapes} == {None, "fp16", "bf16"}
    assert {s.hidden_size // s.num_attention_heads for s in shapes} == {16, 32, 64}
    assert {min(s.num_attention_heads for s in shapes), max(s.num_attention_heads for s in shapes)} == {1, 16}
    assert {s.head_layers for s in shapes} == {1, 2, 3}
    assert {min(s.n_actions for s in shapes), max(s.n_actions for s in shapes)} == {2, 8}
    assert {min(s.max_len for s in shapes), max(s.max_len for s in shapes)} == {128, 2048}
    assert len({s.local_attention for s in shapes}) >= 4 and {s.tokenizer for s in shapes} == {"bpe", "wordpiece"}
    assert any(s.head_gain >= 5 for s in shapes) and any(not s.pin_tokenizer for s in shapes)
    assert set(KIND) == set(MATRIX) and sorted(KIND.values()) == ["aoti"] * 3 + ["onnx"] * 3
    for kind in ("aoti", "onnx"):   # each kind meets a 16-bit checkpoint, both tokenizers and a decisive head
        mine = [MATRIX[n] for n in MATRIX if KIND[n] == kind]
        assert {s.tokenizer for s in mine} == {"bpe", "wordpiece"} and any(s.amp_dtype for s in mine)
        assert any(s.head_gain >= 5 for s in mine)

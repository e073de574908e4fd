"""benchmarks/peer.py runs on a GPU host in one device command; what it can do on a CPU is checked here, so that a
mistake costs a CI minute, not a GPU session: its requests, a mode's child process, the decision comparison and
the report (laya-cuda skipped with its reason)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.bench_scripts.conftest import load_script


@pytest.fixture(scope="module")
def peer():
    return load_script("peer")


def test_the_requests_are_what_the_issue_asks(peer, demo_ckpt, tmp_path):
    from tokenizers import Tokenizer

    made = peer.requests(demo_ckpt, tmp_path / "requests.json", 12, 2)
    assert json.loads((tmp_path / "requests.json").read_text()) == json.loads(json.dumps(made))
    calls = made["calls"]
    assert [len(calls[n][0]) for n in ("1x1 choice, 20 words", "8x3, 120 words", "32x3, 400 words")] == [1, 8, 32]
    assert len(calls["8x3, 120 words"][0][0].split()) == 120 and set(calls["8x3, 120 words"][1]) == {
        "team", "angry", "urgency"}
    tok = Tokenizer.from_file(str(demo_ckpt / "tokenizer" / "tokenizer.json"))
    for t in peer.SINGLE_TOKENS:
        (state,), qs = calls["1x1 at %d tokens" % t]
        n = len(tok.encode(state, add_special_tokens=False).ids)
        assert t - peer.QUESTION_OVERHEAD <= n < t - peer.QUESTION_OVERHEAD + 24 and list(qs) == ["team"]
    assert len(made["stream"]) == 12
    for state, qs in made["stream"]:
        assert 1 <= len(qs) <= 5 and 40 <= len(tok.encode(state, add_special_tokens=False).ids) < 1030
        assert all(2 <= len(q["criteria"]) <= 60 for q in qs.values() if q["type"] == "choice")
    assert len(made["pool"]) == 2 and all(len(states) == 24 and len(qs) == 3 for states, qs in made["pool"])


def test_decisions_are_compared_with_fp32_over_the_pool_and_its_near_ties(peer):
    ref = [[{"c0": ["a", 0.01], "c1": ["b", 0.30]}, {"c0": ["a", 0.04], "c1": ["a", 0.60]}]]
    modes = {"fp32": {"decisions": ref},
             "eager": {"decisions": [[{"c0": ["b", 0], "c1": ["b", 0]}, {"c0": ["a", 0], "c1": ["a", 0]}]]},
             "cuda": {"skipped": "no laya_cuda"}}
    d = peer.decisions(modes, 0.05)
    assert (d["pool"], d["near_ties"]) == (4, 2)
    assert d["eager"] == {"overall": [3, 4], "near": [1, 2]} and "cuda" not in d
    assert peer.decisions({"eager": {}}, 0.05) == {"error": "no fp32 reference yet"}


def test_the_report_renders_partial_runs_and_names_what_was_skipped(peer):
    res = {"command": "python3 benchmarks/peer.py", "device": "cpu", "complete": False, "shapes": {"tiny": {
        "modes": {"eager": {"calls_ms": {"1x1 choice, 20 words": 3.0}, "stream": {"p50_ms": 4.0, "p95_ms": 9.0}},
                  "aot": {"calls_ms": {"1x1 choice, 20 words": 1.5}, "start_to_first_s": 2.5},
                  "cuda": {"calls_ms": {"1x1 choice, 20 words": 2.0}},
                  "cuda-batch": {"skipped": "laya-cuda runs on CUDA only"}},
        "starts": {"aot": [{"start_to_first_s": 1.0, "import_torch_s": 0.5}]},
        "decisions": {"pool": 4, "near_ties": 2, "near_gap": 0.05, "eager": {"overall": [3, 4], "near": [1, 2]}}}}}
    md = peer.markdown(res)
    assert "| 1x1 choice, 20 words | 3.00 | 1.50 | - | - | 2.00 | skipped | - | 0.75x | - |" in md
    assert "| stream p95 | 9.00 |" in md and "| eager | 3 / 4 (75.0%) | 1 / 2 (50.0%) |" in md
    assert "| aot | 2.50 | 1.00 (1) | 0.50 |" in md and "cuda-batch: laya-cuda runs on CUDA only" in md


@pytest.mark.slow  # a child process that imports torch and laya and answers every call (tens of seconds)
def test_a_mode_runs_in_its_own_process_on_the_cpu(peer, demo_ckpt, tmp_path):
    peer.requests(demo_ckpt, tmp_path / "requests.json", 3, 1)
    args = argparse.Namespace(device="cpu", repeats=2, warmups=1)
    result = tmp_path / "eager.json"
    r = peer.spawn("fp32", demo_ckpt, Path("-"), tmp_path, tmp_path / "fp32.json", args, 600)
    assert "error" not in r, r
    r = peer.spawn("eager", demo_ckpt, Path("-"), tmp_path, result, args, 600)
    assert "error" not in r, r
    saved = json.loads(result.read_text())
    assert saved["start_to_first_s"] > 0 and saved["facts"]["backend"] == "eager"
    assert set(saved["calls_ms"]) == set(json.loads((tmp_path / "requests.json").read_text())["calls"])
    assert saved["stream"]["requests"] == 3 and saved["stream"]["timed"] + len(saved["stream"]["refused"]) == 3
    modes = {"fp32": json.loads((tmp_path / "fp32.json").read_text()), "eager": saved}
    d = peer.decisions(modes, 1.0)
    assert d["pool"] == d["near_ties"] == 72 and d["eager"]["overall"] == [72, 72]  # CPU: laya eager is fp32


def test_the_plot_pairs_laya_aot_with_laya_cuda_s_faster_mode():
    rows = load_script("plot_peer").rows({
        "aot": {"calls_ms": {"1x1": 2.0, "8x3": 8.0}, "stream": {"p50_ms": 9.0, "p95_ms": 15.0}},
        "cuda": {"calls_ms": {"1x1": 1.5, "8x3": 25.0}, "stream": {"p50_ms": 13.0}},
        "cuda-batch": {"calls_ms": {"8x3": 18.0}},
        "eager": {"calls_ms": {"1x1": 25.0}}})
    assert rows == [("1x1", {"eager": 25.0, "aot": 2.0, "cuda": 1.5}),
                    ("8x3", {"eager": None, "aot": 8.0, "cuda": 18.0}),
                    ("stream p50", {"eager": None, "aot": 9.0, "cuda": 13.0}),
                    ("stream p95", {"eager": None, "aot": 15.0, "cuda": None})]

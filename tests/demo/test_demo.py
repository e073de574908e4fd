"""The demo checkpoint is a real Laya checkpoint, deterministic, and its answers are not uniform."""
from __future__ import annotations

import json

import numpy as np
import pytest

from laya_aot import demo
from laya_aot.demo import PRESETS, make_checkpoint
from laya_aot.files import sha256_file
from tests.leftovers import killed_leftover

QUESTIONS = {
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "payments",
                                                                           "technical": "errors",
                                                                           "account": "login"}},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high", "critical"]},
}


def test_layout_and_laya_loads_it_unchanged(demo_ckpt):
    import laya

    for name in ("rl_agent_config.json", "model.safetensors", "tokenizer/tokenizer.json", "encoder/config.json"):
        assert (demo_ckpt / name).is_file(), name
    agent = laya.load(str(demo_ckpt), device="cpu")
    assert agent.model.encoder.config.hidden_size == PRESETS["tiny"].hidden_size
    assert len(agent.cfg["act_costs"]) + 1 == PRESETS["tiny"].n_actions


def test_same_seed_same_weights_other_seed_other_weights(demo_ckpt, tmp_path):
    again = make_checkpoint(tmp_path / "again", "tiny", seed=0)
    other = make_checkpoint(tmp_path / "other", "tiny", seed=1)
    assert sha256_file(again / "model.safetensors") == sha256_file(demo_ckpt / "model.safetensors")
    assert sha256_file(other / "model.safetensors") != sha256_file(demo_ckpt / "model.safetensors")


def test_answers_differ_across_options_and_inputs(demo_ckpt):
    import laya

    agent = laya.load(str(demo_ckpt), device="cpu")
    states = ["I was charged twice, please refund me.", "The server is down and nothing works!",
              "Reset my password please.", "Thanks, all good now."]
    res = agent.predict_batch(states, QUESTIONS)
    team = np.array([[r["answers"]["team"]["probabilities"][k] for k in ("billing", "technical", "account")]
                     for r in res])
    assert (team.max(1) - team.min(1) > 0.02).all(), team        # options differ within a question
    assert (team.max(0) - team.min(0) > 0.01).any(), team        # answers differ across inputs
    acts = [r["answers"]["team"]["action"]["act_probability"] for r in res]
    assert max(acts) - min(acts) > 1e-3


def test_alt_shape_differs_everywhere_it_can(alt_ckpt, demo_ckpt):
    a = json.loads((alt_ckpt / "encoder/config.json").read_text())
    d = json.loads((demo_ckpt / "encoder/config.json").read_text())
    ra = json.loads((alt_ckpt / "rl_agent_config.json").read_text())
    rd = json.loads((demo_ckpt / "rl_agent_config.json").read_text())
    assert a["hidden_size"] != d["hidden_size"]
    assert a["hidden_size"] // a["num_attention_heads"] != 64
    assert ra["head_layers"] == 1 and len(ra["act_costs"]) + 1 == 4
    assert ra["max_len"] != rd["max_len"]


def test_unknown_preset_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown demo shape 'nope'"):
        make_checkpoint(tmp_path / "x", "nope")


def test_an_existing_directory_is_reused_only_for_the_same_shape_and_seed(tmp_path):
    out = make_checkpoint(tmp_path / "c", "tiny", seed=0)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert make_checkpoint(out, "tiny", seed=0) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp        # same request: not rewritten
    make_checkpoint(out, "tiny", seed=2)                                   # stale (another seed): rewritten
    assert json.loads((out / "rl_agent_config.json").read_text())["laya_aot_demo"]["seed"] == 2
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(b"not ours")
    with pytest.raises(FileExistsError, match="overwrite"):
        make_checkpoint(foreign, "tiny")
    assert (foreign / "model.safetensors").read_bytes() == b"not ours"   # nothing lost


def _killed_after_writing(path):
    raise KeyboardInterrupt  # the checkpoint is written, the tokenizer config not yet pinned: killed


def test_an_interrupted_write_leaves_what_was_there_and_its_partial_goes_next_time(tmp_path, monkeypatch):
    out = tmp_path / "c"
    killed_leftover(out)                              # a make-demo killed before this one (its process gone)
    monkeypatch.setattr(demo, "_pin_tokenizer_class", _killed_after_writing)
    with pytest.raises(KeyboardInterrupt):
        make_checkpoint(out, "tiny", seed=0)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []   # its own partial discarded, the stale one too
    monkeypatch.undo()
    make_checkpoint(out, "tiny", seed=0)
    monkeypatch.setattr(demo, "_pin_tokenizer_class", _killed_after_writing)
    with pytest.raises(KeyboardInterrupt):
        make_checkpoint(out, "tiny", seed=2)
    # the previous checkpoint stays whole until the new one is complete
    assert json.loads((out / "rl_agent_config.json").read_text())["laya_aot_demo"]["seed"] == 0
    assert demo._not_a_demo_checkpoint(out) is None and sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_makers_of_one_checkpoint_at_once_keep_the_first_published(tmp_path, monkeypatch):
    out, first = tmp_path / "c", {}
    pin = demo._pin_tokenizer_class

    def another_job_publishes_first(path):
        pin(path)
        if not first:
            first["made"] = True
            make_checkpoint(out, "tiny", seed=0)        # a concurrent job of a multirun, done first
            first["inode"] = (out / "model.safetensors").stat().st_ino

    monkeypatch.setattr(demo, "_pin_tokenizer_class", another_job_publishes_first)
    assert make_checkpoint(out, "tiny", seed=0) == out
    assert (out / "model.safetensors").stat().st_ino == first["inode"]    # not swapped under its readers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert oct((out / "model.safetensors").stat().st_mode & 0o777) == oct(0o644)


@pytest.mark.slow  # trains the demo checkpoint, and uses the one `laya-aot demo` trained (conftest.readme_demo)
def test_the_demo_command_checkpoint_is_trained_and_routes_its_states(readme_demo, tmp_path):
    """`laya-aot demo`'s checkpoint answers its three states as a person would, and decisively (issue 22)."""
    import laya

    from laya_aot.commands import DEMO_QUESTIONS, DEMO_STATES
    from laya_aot.demo import DEMO_SHAPE
    from laya_aot.demo.training import tickets

    assert readme_demo.returncode == 0, readme_demo.output
    (ckpt,) = (readme_demo.dir / "artifacts" / "checkpoints").iterdir()   # the one `laya-aot demo` made and trained
    assert json.loads((ckpt / "rl_agent_config.json").read_text())["laya_aot_demo"]["seed"] == 0
    assert not {t["state"] for t in tickets(0, PRESETS[DEMO_SHAPE].train_tickets)} & set(DEMO_STATES)  # held out
    agent = laya.load(str(ckpt), device="cpu")
    answers = [r["answers"]["team"] for r in agent.predict_batch(DEMO_STATES, DEMO_QUESTIONS)]
    assert [a["choice"] for a in answers] == ["billing", "technical", "account"], answers
    assert min(a["answer_confidence"] for a in answers) > 0.6, answers
    again = make_checkpoint(tmp_path / "again", DEMO_SHAPE, seed=0)  # training is seeded: the same bytes again
    assert sha256_file(again / "model.safetensors") == sha256_file(ckpt / "model.safetensors")

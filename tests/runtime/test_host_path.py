"""The host path (runtime/host_path.py): laya's tokens from fewer tokenizer calls, proven equal to laya's own on
fuzzed states and questions, and invisible to agents that do not have it."""
from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

from laya_aot.demo import question_suite, state_text
from laya_aot.runtime import host_path

WORDS = ["refund", "login", "outage", "invoice", "urgent", "Zahlung", "データ", "ünïcödé", "{json}", "\"quoted\"",
         "[MASK]", "<mask>", "  ", "\n", "naïve", "emoji 🙂", "x" * 40]


def _agent(ckpt):
    import laya

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return laya.load(str(ckpt), device="cpu")


def _recording(agent) -> list:
    """Every collated batch the agent's forward sees, copied; the outputs a fixed function of the batch (the
    model is not what is compared, and this keeps the fuzzing fast)."""
    seen: list = []

    def forward(b):
        seen.append({k: (v.clone() if torch.is_tensor(v) else v) for k, v in b.items()})
        ids = b["input_ids"].double()
        rows = (ids * torch.arange(1, ids.shape[1] + 1)).sum(1, keepdim=True) % 97
        logits = torch.cos(rows + torch.arange(b["marker_pos"].shape[1])) * b["marker_mask"]
        acts = torch.softmax(torch.sin(rows + torch.arange(4)), -1)
        return logits.float().numpy(), acts.float().numpy()

    agent._forward = forward
    return seen


def _state(rng: random.Random, mask: str):
    words = [rng.choice(WORDS + [mask]) for _ in range(rng.choice([0, 1, 5, 40, 300]))]
    text = " ".join(words)
    kind = rng.random()
    if kind < 0.6:
        return text
    if kind < 0.8:
        return {"ticket": text, "priority": rng.randint(0, 3), "tags": words[:3]}
    return [{"role": "user", "content": text}, {"role": "agent", "content": " ".join(words[:7])}]


def _questions(rng: random.Random) -> dict:
    suite = list(question_suite().items())
    picked = dict(rng.sample(suite, rng.randint(1, 4)))
    extra = {
        "long_options": {"type": "choice", "instructions": "Which one? " + "very " * rng.randint(0, 60),
                         "criteria": {"opt%d" % i: "description " * rng.randint(1, 30)
                                      for i in range(rng.randint(2, 9))}},
        "structured": {"type": "choice", "instructions": {"ask": "route it", "lang": "de"},
                       "criteria": {"a": {"desc": "payments", "n": 1}, "b": ["x", "y"], "c": None}},
        "labelled": {"type": "noul", "instructions": "Is it urgent?", "labels": {"false": "nein", "true": "ja"}},
        "ordered": {"type": "score", "instructions": "How severe?", "criteria": ["low", "mid", "high"],
                    "option_order": rng.sample([0, 1, 2], 3)},
    }
    for name in rng.sample(sorted(extra), rng.randint(0, 3)):
        picked[name] = extra[name]
    return picked


def _calls(seed: int):
    rng = random.Random(seed)
    for _ in range(12):
        yield rng, rng.randint(1, 9), _questions(rng), rng.choice([{}, {"batch_size": 2}, {"batch_size": 3,
                                                                          "sort_by_length": True},
                                                                  {"max_len": 96, "head_max_len": 40}])


def test_the_host_path_gives_laya_s_own_batches_and_answers_on_fuzzed_calls(demo_ckpt):
    stock, fast = _agent(demo_ckpt), _agent(demo_ckpt)
    path = host_path.install(fast)
    assert path is not None and host_path.of(fast) is path and host_path.of(stock) is None
    stock_batches, fast_batches = _recording(stock), _recording(fast)
    mask = stock.tok.mask_token
    for seed in range(3):  # the same questions again: the second and third rounds come from the cache
        for rng, n, questions, kwargs in _calls(seed):
            states = [_state(rng, mask) for _ in range(n)]
            if n > 2:
                states[-1] = states[0]  # a repeated state in one call
            assert fast.predict_batch(states, questions, **kwargs) == stock.predict_batch(states, questions, **kwargs)
    long_state = state_text(np.random.default_rng(1), 1200)
    questions = {"q": {"type": "noul", "instructions": "Does it mention a refund?"}}
    assert fast.predict_long(long_state, questions) == stock.predict_long(long_state, questions)
    assert len(fast_batches) == len(stock_batches) > 30
    for got, ref in zip(fast_batches, stock_batches):
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]) if torch.is_tensor(ref[k]) else got[k] == ref[k], k
    counts = path.stats
    assert counts["heads_cached"] > counts["heads_built"] > 0
    assert counts["states_batched"] > 0 and counts["states_encoded"] > 0


ONE_STATE_QUESTIONS = {
    "empty_descriptions": {"type": "choice", "instructions": "Which one?", "criteria": {"a": "", "b": None, "c": 0}},
    "one_option": {"type": "choice", "instructions": "Only this?", "criteria": ["only"]},
    "special": {"type": "score", "instructions": "[MASK] <mask> \u200b ünï 🙂 \"q\" {json}",
                "criteria": ["", "[SEP]", {"d": 1}]},
    "noul": {"type": "noul", "instructions": "Is it urgent?"},
}


def _outcome(agent, states, questions, kwargs):
    """An agent's answers, or the type and text of laya's error (a question laya refuses is refused alike)."""
    try:
        return agent.predict_batch(states, questions, **kwargs)
    except Exception as e:  # noqa: BLE001 - compared, not handled
        return "%s: %s" % (type(e).__name__, e)


@pytest.mark.parametrize("ckpt", ["demo_ckpt", "alt_ckpt"])  # alt: head dim 32, fp16, 4 actions, its own vocab
def test_one_state_calls_are_tokenised_when_laya_asks_and_give_laya_s_batches(ckpt, request):
    """A call of one state is not prepared ahead: its state is tokenised by the tokenizer's direct call when
    laya's `_encode_state` asks. Fuzzed one-state calls (every question type, empty and one-option criteria,
    special characters, empty and long states of every kind, budgets) give laya's own batches and answers."""
    ckpt = request.getfixturevalue(ckpt)
    stock, fast = _agent(ckpt), _agent(ckpt)
    path = host_path.install(fast)
    stock_batches, fast_batches = _recording(stock), _recording(fast)
    mask = stock.tok.mask_token
    rng = random.Random(5)
    calls = []
    for i in range(48):
        if i % 4 == 0:  # a service asks the same questions again: their heads then come from the cache
            questions = _questions(rng)
            for name in rng.sample(sorted(ONE_STATE_QUESTIONS), rng.randint(0, 2)):
                questions[name] = ONE_STATE_QUESTIONS[name]
            kwargs = rng.choice([{}, {"batch_size": 1}, {"max_len": 96, "head_max_len": 40}])
        state = _state(rng, mask) if i % 6 else state_text(np.random.default_rng(i), rng.choice([0, 1, 700]))
        calls.append(([state], questions, kwargs))
    # the fast agent's calls first: the two agents share laya's tokenizer, which the stock agent's heads leave
    # truncating (the direct call then leaves the state to laya's call, as it must)
    got = [_outcome(fast, *call) for call in calls]
    assert got == [_outcome(stock, *call) for call in calls]
    assert len(fast_batches) == len(stock_batches) > 30
    for got, ref in zip(fast_batches, stock_batches):
        for k in ref:
            assert torch.equal(got[k], ref[k]) if torch.is_tensor(ref[k]) else got[k] == ref[k], k
    counts = path.stats
    assert counts["states_direct"] > 20 and "states_batched" not in counts
    # a head built by laya leaves the transformers backend truncating: the next state is laya's own call
    assert 0 < counts["states_alone"] <= counts["heads_built"]


def test_heads_are_keyed_by_everything_build_head_reads(demo_ckpt):
    """Same instruction, other options, labels, order or budget: each a head of its own, as laya builds it."""
    import laya.common

    agent = _agent(demo_ckpt)
    path = host_path.install(agent)
    base = {"t": "choice", "ins": "Which team?", "crit": {"billing": None, "technical": None}}
    variants = [
        (base, 192, None), (base, 192, [1, 0]), (base, 24, None),
        (dict(base, crit={"billing": "payments", "technical": None}), 192, None),
        ({"t": "noul", "ins": "Which team?", "crit": None}, 192, None),
        ({"t": "noul", "ins": "Which team?", "crit": None, "labels": {"false": "no", "true": "yes"}}, 192, None),
    ]
    stock = laya.common.build_head.laya_aot_stock
    for _ in range(2):
        for q, budget, order in variants:
            token = host_path._CALL.set(host_path._Call(path))
            try:
                got = laya.common.build_head(agent.tok, q, budget, option_order=order)
            finally:
                host_path._CALL.reset(token)
            assert got == stock(agent.tok, q, budget, option_order=order)
    assert path.stats == {"heads_built": len(variants), "heads_cached": len(variants)}


def test_a_budget_laya_refuses_is_refused_after_an_equal_one_it_took(demo_ckpt):
    """`head_max_len=128.0` equals 128 as a key, and laya raises for it: the cache must not answer it with the head
    laya built for 128 (whether a call answered or raised depended on the calls before it)."""
    stock, fast = _agent(demo_ckpt), _agent(demo_ckpt)
    host_path.install(fast)
    q = {"team": {"type": "choice", "instructions": "Which team?", "criteria": ["billing", "tech"]}}
    for agent in (stock, fast):
        agent.system_one("I was charged twice", q)
    with pytest.raises(TypeError) as want:
        stock.system_one("I was charged twice", q, head_max_len=128.0)
    with pytest.raises(TypeError) as got:
        fast.system_one("I was charged twice", q, head_max_len=128.0)
    assert str(got.value) == str(want.value)


def test_the_head_cache_stays_bounded(demo_ckpt, monkeypatch):
    monkeypatch.setattr(host_path, "HEADS_KEPT", 3)
    agent = _agent(demo_ckpt)
    path = host_path.install(agent)
    for i in range(10):
        agent.predict_batch(["a state"], {"q": {"type": "noul", "instructions": "question %d?" % i}})
    assert len(path._heads) == 3


def test_agents_without_a_host_path_run_laya_s_stock_functions(demo_ckpt):
    fast, plain = _agent(demo_ckpt), _agent(demo_ckpt)
    path = host_path.install(fast)
    assert host_path.install(fast) is path  # once per agent
    q = {"q": {"type": "noul", "instructions": "Is it urgent?"}}
    fast.predict_batch(["one", "two"], q)
    before = path.stats
    plain.predict_batch(["one", "two", "three"], q)
    assert path.stats == before  # the other agent's call touched nothing of this one's


def test_a_state_laya_cannot_read_raises_laya_s_own_error(demo_ckpt):
    stock, fast = _agent(demo_ckpt), _agent(demo_ckpt)
    host_path.install(fast)
    q = {"q": {"type": "noul", "instructions": "Is it urgent?"}}
    bad = ["fine", {"not json": object()}]
    with pytest.raises(TypeError) as want:
        stock.predict_batch(bad, q)
    with pytest.raises(TypeError) as got:
        fast.predict_batch(bad, q)
    assert str(got.value) == str(want.value)


def test_within_a_call_a_question_s_head_is_found_by_the_object_laya_hands(demo_ckpt, monkeypatch):
    """Every state of a call asks for the same question objects: the head comes from the call's memo, without
    rendering the options again; another object with the same content comes from the agent's cache."""
    import laya.common

    agent = _agent(demo_ckpt)
    path = host_path.install(agent)
    q = {"t": "choice", "ins": "Which team?", "crit": {"billing": "payments", "technical": None}}
    rendered = []
    real = host_path.laya_api.render_options
    monkeypatch.setattr(host_path.laya_api, "render_options", lambda qq: rendered.append(1) or real(qq))
    stock = laya.common.build_head.laya_aot_stock
    token = host_path._CALL.set(host_path._Call(path))
    try:
        for _ in range(3):
            assert laya.common.build_head(agent.tok, q, 192) == stock(agent.tok, q, 192)
        assert len(rendered) == 1
        twin = dict(q)
        assert laya.common.build_head(agent.tok, twin, 192) == stock(agent.tok, twin, 192)
        assert laya.common.build_head(agent.tok, q, 40) == stock(agent.tok, q, 40)  # another budget: another head
        assert len(rendered) == 3
    finally:
        host_path._CALL.reset(token)
    assert path.stats == {"heads_built": 2, "heads_cached": 3}


def test_a_question_whose_options_do_not_fit_raises_laya_s_own_error(demo_ckpt):
    """The items are assembled from the call's heads (`HostPath.encode_state`); where laya's `_encode_state` refuses
    a question (its option markers past max_len) the host path raises the same error, and a list state keeps its
    newest tokens as laya's does."""
    stock, fast = _agent(demo_ckpt), _agent(demo_ckpt)
    host_path.install(fast)
    many = {"q": {"type": "choice", "instructions": "Which one?",
                  "criteria": {"opt%d" % i: "description " * 20 for i in range(9)}}}
    states = ["one", "two " * 50]
    want, got = (_outcome(a, states, many, {"max_len": 60, "head_max_len": 192}) for a in (stock, fast))
    assert isinstance(want, str) and want.startswith("ValueError") and got == want
    turns = [[{"role": "user", "content": "word " * 400}, {"role": "agent", "content": "newest " * 30}]] * 2
    noul = {"q": {"type": "noul", "instructions": "Is it urgent?"}}
    assert fast.predict_batch(turns, noul, max_len=64) == stock.predict_batch(turns, noul, max_len=64)


# ------------------------------------------------------------------------------------------------ plain calls
def test_plain_calls_give_laya_s_own_results_to_the_last_bit(demo_ckpt):
    """A call with no hooks, gate or windows is computed by `laya_internals.plain_predict_batch`: on fuzzed calls
    (1 to 9 states of every kind, every question type, option orders, structured criteria, budgets, a `lang`,
    batch sizes that hold every state, laya's errors for a question it refuses) its results are laya's method's,
    key order and every float included, from laya's own batches."""
    import json

    stock, fast = _agent(demo_ckpt), _agent(demo_ckpt)
    path = host_path.install(fast)
    assert path.plain is not None
    stock_batches, fast_batches = _recording(stock), _recording(fast)
    mask = stock.tok.mask_token
    rng = random.Random(7)
    plain = 0
    for i in range(40):
        n = rng.choice([1, 1, 2, 5, 9])
        questions = _questions(rng)
        if i % 3 == 0:
            questions.update(rng.sample(sorted(ONE_STATE_QUESTIONS.items()), rng.randint(1, 2)))
        if i % 10 == 9:
            questions["bad"] = {"type": "ranking", "instructions": "?"}  # laya refuses it: its own error
        kwargs = rng.choice([{}, {"batch_size": n}, {"batch_size": n + 3, "sort_by_length": True},
                             {"max_len": 96, "head_max_len": 40}, {"lang": "de-AT"}])
        states = [_state(rng, mask) for _ in range(n)]
        got, want = _outcome(fast, states, questions, kwargs), _outcome(stock, states, questions, kwargs)
        assert json.dumps(got) == json.dumps(want)
        plain += not isinstance(want, str)  # a refused question: laya's error, raised in the plain call too
    assert len(fast_batches) == len(stock_batches) > 30
    for got, ref in zip(fast_batches, stock_batches):
        for k in ref:
            assert torch.equal(got[k], ref[k]) if torch.is_tensor(ref[k]) else got[k] == ref[k], k
    assert path.stats["plain_calls"] == plain > 30


def test_calls_with_hooks_a_gate_or_windows_run_laya_s_method(demo_ckpt):
    """Anything a plain call does not cover (hooks installed, set for the process or passed, a confidence gate, a
    hook setting, batches smaller than the call, states not in a list, extra positional arguments) is laya's
    method, and gives its results."""
    import laya.hooks

    stock, fast = _agent(demo_ckpt), _agent(demo_ckpt)
    path = host_path.install(fast)
    _recording(stock), _recording(fast)
    q = {"q": {"type": "noul", "instructions": "Is it urgent?"},
         "c": {"type": "choice", "instructions": "Which team?", "criteria": ["billing", "tech"]}}
    states = ["refund please", "the site is down", "login fails"]
    seen = []

    class Hook:
        def on_predict_end(self, ctx):
            seen.append(len(ctx.results))

    cases = [((states, q), {"hooks": [Hook()]}), ((states, q), {"on_predict_end": lambda ctx: seen.append(0)}),
             ((states, q), {"min_confidence": 0.9}), ((states, q), {"hooks_timeout": 5.0}),
             ((states, q), {"hooks_raise": True}), ((states, q), {"batch_size": 2}),
             ((tuple(states), q), {}), ((states, q, None, "de"), {})]
    for args, kwargs in cases:
        assert fast.predict_batch(*args, **kwargs) == stock.predict_batch(*args, **kwargs)
    fast.add_hook(Hook())
    assert fast.predict_batch(states, q) == stock.predict_batch(states, q)
    fast.remove_hook(fast.hooks[0])
    laya.hooks.add_default_hook(Hook())
    try:
        assert fast.predict_batch(states, q) == stock.predict_batch(states, q)
    finally:
        laya.hooks.clear_default_hooks()
    assert "plain_calls" not in path.stats
    assert len(seen) == 2 + 2 + 1 + 2  # the hooks ran: those passed (both agents), the installed one, the process's
    assert fast.predict_batch(states, q) == stock.predict_batch(states, q)
    assert path.stats["plain_calls"] == 1


def test_another_predict_batch_gets_no_plain_call(demo_ckpt, monkeypatch):
    """The plain call is laya's method as its source reads here: another source (a laya upgrade) or a subclass's
    own method leaves every call to laya's method."""
    import laya.agent

    from laya_aot.laya_internals import host_path as internals

    agent = _agent(demo_ckpt)
    assert internals.plain_predict_batch(agent) is not None
    monkeypatch.setattr(internals, "AGENT_SOURCE_SHA256", "0" * 64)
    assert internals.plain_predict_batch(agent) is None
    monkeypatch.undo()

    class Own(laya.agent.Agent):
        def predict_batch(self, *args, **kwargs):
            return super().predict_batch(*args, **kwargs)

    agent.__class__ = Own
    assert internals.plain_predict_batch(agent) is None

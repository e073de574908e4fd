"""The host path's cheaper steps (runtime/host_steps.py, laya_internals.state_encoder) against laya's own, bit for
bit on fuzzed inputs, and mutations of them that these comparisons catch."""
from __future__ import annotations

import contextlib
import json
import random
import warnings

import numpy as np
import pytest

from laya_aot import laya_internals as laya_api
from laya_aot.runtime import host_path, host_steps

TEXT_PIECES = ["refund", "login", "outage", " ", "  ", "\n", "\t", "Zahlung", "データ", "ünïcödé", "naïve café",
               "emoji 🙂👍🏽", "{\"json\": [1, 2]}", "\"quoted\"", "[CLS]", "[SEP]", "[PAD]", "[MASK]", "<mask>",
               "[UNK]", "x" * 60, "1e-9", "user@example.com", "\u200b", "\u00a0", "\ufeff", "Is n't it ?", "'s"]


def _agent(ckpt):
    import laya

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return laya.load(str(ckpt), device="cpu")


def _texts(rng: random.Random, n: int) -> list:
    return ["".join(rng.choice(TEXT_PIECES) + rng.choice(["", " "]) for _ in range(rng.choice([0, 1, 3, 30, 200])))
            for _ in range(n)]


# ------------------------------------------------------------------------------------------------ the tokenizer
def test_the_direct_tokenizer_call_gives_laya_s_ids_on_fuzzed_texts(demo_ckpt):
    from laya_aot.tokenizer_snapshot import SnapshotTokenizer, derive

    agent = _agent(demo_ckpt)
    real = agent.tok
    snap = SnapshotTokenizer(derive(str(demo_ckpt / "tokenizer")), lambda: real)
    rng = random.Random(0)
    for tok in (real, snap):
        encode = laya_api.state_encoder(tok)
        assert encode is not None
        for n in (1, 2, 7, 40):
            for _ in range(6):
                texts = _texts(rng, n)
                want = laya_api.encode_texts(tok, texts)
                got = encode(texts)
                assert got == want
                assert all(type(i) is int for ids in got for i in ids)


def test_the_direct_call_leaves_a_backend_laya_s_call_would_reset_to_laya(demo_ckpt):
    """A truncating call (laya's option texts) leaves the transformers backend truncating; laya's next plain call
    resets it. The direct call then answers None (laya's call runs) and changes nothing itself."""
    agent = _agent(demo_ckpt)
    tok = agent.tok
    encode = laya_api.state_encoder(tok)
    tok("an option text that is long enough", add_special_tokens=False, truncation=True, max_length=3)
    backend = tok._tokenizer
    assert backend.truncation is not None
    assert encode(["a state"]) is None
    assert backend.truncation is not None  # untouched
    laya_api.encode_texts(tok, ["a state"])  # laya's call resets it, as transformers does
    assert encode(["a state"]) == laya_api.encode_texts(tok, ["a state"])


def test_other_tokenizer_classes_get_no_direct_call(demo_ckpt):
    agent = _agent(demo_ckpt)

    class Subclass(type(agent.tok)):  # a class that may do anything in its call
        pass

    tok = agent.tok
    tok.__class__ = Subclass
    try:
        assert laya_api.state_encoder(tok) is None
    finally:
        tok.__class__ = Subclass.__bases__[0]
    assert laya_api.state_encoder(object()) is None


def test_a_direct_call_without_its_guard_fails_the_comparison(demo_ckpt):
    """The mutation check: the backend called as it is after a truncating call (the guard left out) gives other
    ids than laya's call on a long text, which the comparison above would catch."""
    agent = _agent(demo_ckpt)
    tok = agent.tok
    texts = _texts(random.Random(3), 4) + ["refund " * 40]
    tok("an option text", add_special_tokens=False, truncation=True, max_length=8)
    unguarded = [e.ids for e in tok._tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    assert unguarded != laya_api.encode_texts(tok, texts)


# ------------------------------------------------------------------------------------------------- the decoder
def _questions(rng: random.Random) -> dict:
    out = {}
    for i in range(rng.randint(1, 5)):
        t = rng.choice(["choice", "score", "noul"])
        k = 2 if t == "noul" else rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 9, 12])
        if t == "choice":
            labels = rng.choice([["opt%d" % j for j in range(k)], list(range(k)), [str(j * 1.5) for j in range(k)]])
            q = {"type": t, "instructions": "which?", "criteria": labels}
        elif t == "score":
            q = {"type": t, "instructions": "how much?",
                 "criteria": [rng.choice(["low", {"d": j}, [j, "x"], j]) for j in range(k)]}
        else:
            q = {"type": t, "instructions": "is it?"}
            if rng.random() < 0.3:
                q["labels"] = {"false": "nein", "true": "ja"}
        if rng.random() < 0.3:
            q["option_order"] = rng.sample(range(k), k)
        out["q%d" % i] = q
    return out


def _logits(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    kind = rng.integers(0, 5)
    scale = [1e-4, 1.0, 8.0, 80.0, 3e4][kind]
    x = (rng.standard_normal((rows, width)) * scale).astype(np.float32)
    if rng.random() < 0.3:
        x[rng.random((rows, width)) < 0.3] = -1e4  # masked columns, as the head fills them
    if rng.random() < 0.3:
        x = x.round()  # ties
    return x


def _batch(agent, rng: random.Random, nrng: np.random.Generator, states: int = 0):
    questions = _questions(rng)
    ids = list(questions)
    internal = {qid: agent._to_internal(questions[qid]) for qid in ids}
    ks = [2 if internal[q]["t"] == "noul" else len(internal[q]["crit"]) for q in ids]
    items = [{"markers": list(range(k)), "qtype": 0} for k in ks]
    states = states or rng.choice([1, 2, 3, 8, 33])
    width = max(ks) + rng.randint(0, 2)
    logits = _logits(nrng, states * len(ids), width)
    if rng.random() < 0.05 and not agent.binning_map:  # (laya's binning raises its own error on a NaN)
        logits[nrng.integers(0, logits.shape[0]), nrng.integers(0, width)] = rng.choice([np.inf, -np.inf, np.nan])
    act = nrng.random((states * len(ids), 4)).astype(np.float32)
    return logits, act, items, ids, internal, states


def _calibrate(agent, rng: random.Random) -> None:
    """Temperatures of the forms laya holds (floats, an int, a numpy float), per option bucket, and at times a
    binning map."""
    agent.temperature = [rng.choice([1.0, 0.73, 2, 1.7]) for _ in range(3)]
    agent.temperature_by_options = {b: rng.choice([0.5, 1.3, np.float64(0.9), 3]) for b in
                                    rng.sample(["choice:2", "choice:3-5", "choice:6-10", "score:3-5", "noul:2"], 3)}
    agent.binning_map = None
    if rng.random() < 0.3:
        agent.binning_map = {"choice:3-5": {"bins": 4, "values": [0.1, 0.4, 0.6, 0.93]},
                             "noul:2": {"bins": 2, "values": [0.3, 0.8]}}


@contextlib.contextmanager
def _unrounded():
    """`round` a no-op in laya's agent module and in host_steps: the decoders' numbers compared before laya's
    rounding to 4 decimals, which would hide a difference in the last bits of most of them."""
    import laya.agent

    keep = lambda x, n=None: x  # noqa: E731
    laya.agent.round = host_steps.round = keep
    try:
        yield
    finally:
        del laya.agent.round, host_steps.round


def _compare(agent, dec, rounds: int, seed: int, states: int = 0) -> int:
    """Decoded answers against laya's `_decode_answers` on `rounds` fuzzed batches (of `states` states, 0: of
    any number) (JSON text equal: every float to its last bit); the number of questions the decoder decoded
    itself."""
    stock = laya_api.stock_decode(agent)
    rng, nrng = random.Random(seed), np.random.default_rng(seed)
    own = 0
    for _ in range(rounds):
        _calibrate(agent, rng)
        logits, act, items, ids, internal, states = _batch(agent, rng, nrng, states)
        cache: dict = {}
        for s in range(states):
            offset = s * len(ids)
            with np.errstate(all="ignore"):
                want = stock(logits, act, items, ids, internal, offset)
                got = dec.decode(cache, logits, act, items, ids, internal, offset)
            assert json.dumps(got) == json.dumps(want), (ids, internal, offset)
        own += sum(1 for k in cache if isinstance(k, tuple) and cache[k] is not None)
    return own


def test_the_decoder_gives_laya_s_answers_on_fuzzed_batches(demo_ckpt):
    agent = _agent(demo_ckpt)
    dec = host_steps.Decoder(agent)
    assert _compare(agent, dec, 300, seed=1) > 300  # as served: rounded; most questions decoded in blocks
    with _unrounded():
        assert _compare(agent, dec, 300, seed=4) > 300  # every number before rounding, bit for bit


@pytest.mark.parametrize("ckpt", ["demo_ckpt", "alt_ckpt"])  # alt: head dim 32, fp16, 4 actions, its own vocab
def test_one_state_batches_are_decoded_in_python_floats_bit_for_bit(ckpt, request, monkeypatch):
    """A batch of one state (a 1-row call) is decoded by `Decoder._row`, in Python floats rounded as numpy's
    float32 operations round: against laya's function on fuzzed one-state batches (every question type, 1 to 12
    options, shuffled orders, ties, extreme and non-finite logits, temperatures of every form laya holds), every
    number before rounding. Mutated (the float32 rounding left out) it differs, and the self-check says so."""
    agent = _agent(request.getfixturevalue(ckpt))
    dec = host_steps.Decoder(agent)
    assert _compare(agent, dec, 300, seed=5, states=1) > 200  # as served: rounded
    with _unrounded():
        assert _compare(agent, dec, 400, seed=6, states=1) > 300  # every number, bit for bit
    agent.temperature, agent.temperature_by_options, agent.binning_map = [1.0, 1.0, 1.0], {}, None
    assert host_steps.self_check(agent) is None
    monkeypatch.setattr(host_steps, "_f32", lambda x: x)  # the arithmetic left in double
    assert host_steps.self_check(agent) is not None
    with _unrounded(), pytest.raises(AssertionError):
        _compare(agent, host_steps.Decoder(agent), 400, seed=6, states=1)


@pytest.mark.parametrize("mutated", [
    lambda a: np.add.accumulate(a[:, ::-1], axis=1)[:, -1] + 0.0,      # the other order
    lambda a: a.astype(np.float64).sum(axis=1).astype(a.dtype),          # another precision
], ids=["reversed", "float64"])
def test_a_changed_sum_fails_the_comparison_and_the_self_check(demo_ckpt, monkeypatch, mutated):
    """The mutation check: the row sums done otherwise are found by the fuzzed comparison and by the check a
    process runs before its first use (which then leaves every answer to laya)."""
    agent = _agent(demo_ckpt)
    assert host_steps.self_check(agent) is None
    monkeypatch.setattr(host_steps, "_fold", mutated)
    assert host_steps.self_check(agent) is not None
    with _unrounded(), pytest.raises(AssertionError):
        _compare(agent, host_steps.Decoder(agent), 300, seed=2)


def test_a_failed_check_leaves_every_answer_to_laya(demo_ckpt, monkeypatch):
    agent = _agent(demo_ckpt)
    monkeypatch.setattr(host_steps, "_CHECKED", {"decode": False})
    path = host_path.install(agent)
    calls = []
    stock = path.decoder.stock
    monkeypatch.setattr(path.decoder, "stock", lambda *a, **k: calls.append(1) or stock(*a, **k))
    monkeypatch.setattr(path.decoder, "decode", lambda *a, **k: pytest.fail("the batched decoder ran"))
    agent.predict_batch(["one", "two", "three"], {"q": {"type": "noul", "instructions": "Is it urgent?"}})
    assert len(calls) == 3


def test_a_lang_or_many_options_go_to_laya_s_function(demo_ckpt):
    agent = _agent(demo_ckpt)
    dec = host_steps.Decoder(agent)
    internal = {"c": agent._to_internal({"type": "choice", "instructions": "x", "criteria": ["o%d" % i
                                                                                            for i in range(9)]})}
    items = [{"markers": list(range(9))}]
    logits = np.random.default_rng(0).standard_normal((4, 9)).astype(np.float32)
    act = np.full((4, 4), 0.25, dtype=np.float32)
    cache: dict = {}
    for offset in range(4):
        assert dec.decode(cache, logits, act, items, ["c"], internal, offset) == \
            agent._decode_answers(logits, act, items, ["c"], internal, offset)
    assert cache[(0, "c")] is None  # nine options: pairwise sums, laya's own
    agent.lang_temperatures = {"de": {"temperature": [2.0, 2.0, 2.0], "temperature_by_options": {}}}
    seen = []
    dec.stock = lambda *a, **k: seen.append(k) or {}
    dec(cache, logits, act, items, ["c"], internal, 0, "de-AT")
    assert seen == [{"lang": "de-AT"}]


def test_predict_batch_through_the_host_path_gives_laya_s_unrounded_numbers(demo_ckpt):
    """End to end, every number of every answer before laya's rounding: fuzzed calls (states, questions, batch
    sizes, budgets) through a host-path agent and laya's stock agent, on the same logits."""
    from tests.runtime.test_host_path import _calls, _recording, _state

    stock, fast = _agent(demo_ckpt), _agent(demo_ckpt)
    path = host_path.install(fast)
    _recording(stock), _recording(fast)
    mask = stock.tok.mask_token
    with _unrounded():
        for seed in range(2):
            for rng, n, questions, kwargs in _calls(seed + 10):
                states = [_state(rng, mask) for _ in range(n)]
                want = stock.predict_batch(states, questions, **kwargs)
                assert json.dumps(fast.predict_batch(states, questions, **kwargs)) == json.dumps(want)
    counts = path.stats
    assert counts["states_batched"] > 0 and counts["questions_decoded_in_blocks"] > 20


# ------------------------------------------------------------------------------------------------ collation
def _items(rng: random.Random) -> list:
    """Agent._encode_state-shaped items: ragged ids and markers (none at all included), a question's stats."""
    def item() -> dict:
        k = rng.choice([0, 1, 2, 5, 7])
        return {"ids": [rng.randrange(0, 50000) for _ in range(rng.choice([1, 2, 9, 64, 300]))],
                "markers": sorted(rng.sample(range(1, 400), k)), "qtype": rng.randrange(3),
                "options": {"options": k, "options_distinct": k, "tokens_per_option": None},
                "state_stats": {"state_tokens": 3, "state_tokens_used": 3, "state_tokens_dropped": 0,
                                "truncated": False}}
    return [[item() for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(1, 9))]


def test_the_collation_gives_laya_s_arrays_on_fuzzed_items(monkeypatch):
    import laya.common
    import torch

    monkeypatch.setattr(host_steps, "COLLATE_ROWS", 1)  # every batch through the masked assignments
    stock = laya.common.collate_items
    rng = random.Random(5)
    for _ in range(300):
        batch, pad = _items(rng), rng.choice([0, 1, 3, 50280])
        got, want = host_steps.collate(stock, batch, pad), stock(batch, pad)
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert (torch.equal(got[k], v) and got[k].dtype == v.dtype and got[k].stride() == v.stride()
                    if torch.is_tensor(v) else got[k] == v), k
    # what only laya's function handles goes there: a training target, a label, a parallel layout
    for extra in ({"target": [1.0]}, {"label": 2}, {"layout": {"position_ids": [0], "option_ids": [0]}}):
        batch = [[dict(_items(rng)[0][0], **extra)]]
        calls = []

        def spy(b, p, calls=calls):
            calls.append(1)
            return stock(b, p)

        host_steps.collate(spy, batch, 0)
        assert calls, extra

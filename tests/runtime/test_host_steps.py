"""The host path's cheaper steps (laya_internals.state_encoder) against laya's own, bit for bit on fuzzed inputs,
and mutations of them that these comparisons catch."""
from __future__ import annotations

import random
import warnings

from laya_aot import laya_internals as laya_api

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
    from laya_aot.tokenizer_snapshot import SnapshotTokenizer, _snapshot_of

    agent = _agent(demo_ckpt)
    real = agent.tok
    snap = SnapshotTokenizer(_snapshot_of(real), lambda: real)
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

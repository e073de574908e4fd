"""Every entry of the per-machine cache is a hint, never an authority: damaged, stale, swapped, poisoned, a FIFO, a
link to /dev/zero, a directory or valid JSON of the wrong type in place of any of them is read as a miss (the value
is recomputed) or, where it is a well-formed record, as what it says; never an exception, never a hang, never a
value the entry's owner would not have written for this key. One test per cache: digests, probe verdicts,
verify-here verdicts, start costs, tokenizer snapshots, the TileLang kernel cache; the pack cache and the loads
themselves are in test_cache_fuzz.py."""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import random
import threading
from pathlib import Path

import pytest

from laya_aot import files, kinds, probe
from laya_aot.manifest import Bundle
from laya_aot.variant import current_machine
from tests.reliability.cache_damage import GENERIC, damage, poison

SAMPLE = Path(__file__).resolve().parents[1] / "shared" / "demo_manifest.json"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="module")
def sample() -> Bundle:
    """The demo bundle's manifest (no build): its artifacts are what the verdicts and start costs are kept for."""
    return Bundle.from_dict(json.loads(SAMPLE.read_text()), kinds.BY_NAME)


def _within(seconds: float, fn, *args):
    """fn(*args) in a thread, which must return within `seconds` (a FIFO must never block a read)."""
    out = {}
    t = threading.Thread(target=lambda: out.update(value=fn(*args)), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "%s hung" % getattr(fn, "__name__", fn)
    return out["value"]


def _damaged_entries(path: Path, other: Path, kind: str, seed: int = 0):
    """`path` damaged every GENERIC way and poisoned (as `kind`) a few times; yields what was done each time, with
    the entry as it was written first put back in between."""
    good = path.read_bytes()
    rng = random.Random(seed)
    for how in GENERIC + ("poison",) * 4:
        done = poison(path, kind, rng) if how == "poison" else damage(path, how, rng, other)
        yield done
        damage(path, "empty", rng)
        path.write_bytes(good)


# ------------------------------------------------------------------------------------------- the helper itself
def test_the_reader_answers_a_miss_for_anything_but_a_regular_file_of_the_expected_shape(tmp_path):
    entry, other = tmp_path / "entry.json", tmp_path / "other.json"
    fields = {"n": files.finite_number, "name": str, "digest": files.sha256_hex}
    good = {"n": 3, "name": "x", "digest": "a" * 64, "extra": [1]}
    entry.write_text(json.dumps(good))
    other.write_text(json.dumps(dict(good, name="y")))
    assert files.read_cache_json(entry, fields) == good
    seen = 0
    for done in _damaged_entries(entry, other, "other"):
        got = _within(10, files.read_cache_json, entry, fields)
        if done == "swapped":
            assert got == dict(good, name="y")   # another well-formed entry reads as what it says
        elif done.endswith(" extra"):   # a field nobody checks (or reads) may hold anything
            assert got is not None and {k: got[k] for k in fields} == {k: good[k] for k in fields}, done
        else:
            assert got is None, done
        seen += 1
    assert seen == len(GENERIC) + 4
    for bad in ({"n": True}, {"n": "3"}, {"n": float("nan")}, {"digest": "A" * 64}, {"digest": "a" * 63}):
        entry.write_text(json.dumps(dict(good, **bad)))
        assert files.read_cache_json(entry, fields) is None, bad
    entry.write_bytes(b'{"n": 1, "name": "x", "digest": "' + b"a" * 64 + b'", "pad": "' + b"x" * (2 << 20) + b'"}')
    assert files.read_cache_json(entry, fields) is None   # past the bound: refused before it is parsed


# ------------------------------------------------------------------------------------------------------ digests
def test_a_damaged_digest_entry_is_recomputed(cache, tmp_path):
    """Valid JSON of the wrong type raised TypeError out of load(), a FIFO hung it, a link to /dev/zero grew to
    gigabytes: now each is a miss, and the digest is the file's."""
    data = tmp_path / "weights.bin"
    data.write_bytes(os.urandom(1 << 16))
    other = tmp_path / "other.bin"
    other.write_bytes(b"other")
    want, want_parts = files.sha256_file(data), files.sha256_parts(data)
    assert files.cached_sha256(data) == want and files.cached_sha256_parts(data) == want_parts
    files.cached_sha256(other)
    entries = sorted((cache / "digests").iterdir(), key=lambda p: p.name)
    assert len(entries) == 3
    by_content = {p: json.loads(p.read_text()) for p in entries}
    mine = [p for p, rec in by_content.items() if rec["path"] == str(data.resolve())]
    theirs = next(p for p, rec in by_content.items() if rec["path"] == str(other.resolve()))
    for entry in mine:
        for done in _damaged_entries(entry, theirs, "digest"):
            got = (_within(20, files.cached_sha256, data), _within(20, files.cached_sha256_parts, data))
            if done == "poisoned: another digest":
                continue   # a well-formed entry naming another digest: see the trust model (docs/trust.md)
            assert got == (want, want_parts), done


def test_a_digest_entry_saves_a_hash_but_never_refuses_a_file_nor_vouches_for_one_in_the_cache(cache, tmp_path):
    """A well-formed entry naming another digest (one hex digit changed) refused an intact bundle or checkpoint on
    every start, with the wrong fix; and an unpacked pack's files, which live in the cache, were vouched for by
    entries anyone who can write them can write too."""
    data = tmp_path / "weights.bin"
    data.write_bytes(os.urandom(1 << 16))
    want = files.sha256_file(data)
    assert files.cached_sha256(data) == want
    entry, = (cache / "digests").iterdir()
    forged = "0" * 64
    entry.write_text(json.dumps({"path": str(data.resolve()), "sha256": forged}))
    assert files.cached_sha256(data, want) == want                   # the comparison's digest: computed again
    assert json.loads(entry.read_text())["sha256"] == want           # and the entry rewritten
    inside = cache / "packs" / "0123" / "model.onnx"
    inside.parent.mkdir(parents=True)
    inside.write_bytes(b"the unpacked file")
    true = files.sha256_file(inside)
    key = __import__("hashlib").sha256(files._stat_key(inside).encode()).hexdigest()
    (cache / "digests" / (key + ".json")).write_text(json.dumps({"path": str(inside.resolve()), "sha256": forged}))
    assert files.cached_sha256(inside) == true and files.cached_sha256(inside, forged) == true


# ------------------------------------------------------------------------------------------------ probe verdicts
def _verdict(art, reason=None):
    return {"artifact": art.name, "sha256": art.sha256, "reason": reason, "graphs": None, "seconds": 1.0,
            "machine": current_machine("cpu").as_dict(), "device": "cpu", "when": "2026-01-01T00:00:00Z"}


def test_a_damaged_probe_verdict_means_the_child_runs_again(cache, sample):
    """Anything but a verdict this machine's child wrote for this very artifact is none: the loader runs the
    child (`probe.begin` starts one), never the artifact in-process on the strength of a damaged entry."""
    machine = current_machine("cpu")
    art, twin = sample.artifact("aoti-cpu"), sample.artifact("aoti-cpu-frozen")
    for a, reason in ((art, None), (twin, "loading it crashed a probe process: SIGABRT")):
        path = probe.verdict_path(a, machine, "cpu")
        path.parent.mkdir(parents=True, exist_ok=True)
        files.write_json_atomic(path, _verdict(a, reason))
    path, other = probe.verdict_path(art, machine, "cpu"), probe.verdict_path(twin, machine, "cpu")
    assert probe.cached_verdict(art, machine, "cpu")["reason"] is None
    for done in _damaged_entries(path, other, "verdict"):
        got = _within(10, probe.cached_verdict, art, machine, "cpu")
        if done == "poisoned: failed":
            assert got["reason"].startswith("a probe process")   # a failed verdict: the artifact is not used
        elif done == "poisoned: graphs":
            assert got["reason"] is None and got["graphs"]   # CUDA graphs off: slower, never wrong
        elif got is not None:   # a field the reader does not use was changed: still this artifact's verdict
            assert done.split()[0] in ("field_type", "field_missing", "nan"), done
            assert (got["artifact"], got["sha256"], got["reason"]) == (art.name, art.sha256, None), done
        assert done not in ("swapped", "fifo", "dev_zero", "directory", "oversize", "link_to_entry") or got is None
        assert probe.cached_verdict(dataclasses.replace(art, probe_verdict=None), machine, "cpu") == got


# ------------------------------------------------------------------------------------------ verify-here verdicts
def test_a_damaged_verify_here_verdict_is_verified_again(cache, sample):
    """The verdict of an artifact verified on this machine (cross-compiled TileLang) gives the smoke check its bound:
    anything but one `_store_verdict` wrote for this artifact is none, so the artifact is verified again."""
    from laya_aot.manifest import VerifyResult
    from laya_aot.numerics.tolerance import Agreement, DecisionAgreement
    from laya_aot.runtime import trial

    art, twin = sample.artifact("aoti-cpu"), sample.artifact("onnx-fp32")
    res = VerifyResult(passed=True, tolerance=0.01, rule="relative", eager_in_dtype=Agreement(1e-3, 2e-3, 0.99),
                       decisions=DecisionAgreement(256, 0.99, 0.98, 1, 2, 0.5, 0.01), max_abs_option_prob=1e-3,
                       max_abs_action_prob=2e-3, argmax_agreement=1.0)
    path, other = cache / "probes" / "verify.json", cache / "probes" / "other-verify.json"
    # what a faithful build's statement holds: a near-tie part, the products' dtype and laya as it serves
    near = dataclasses.replace(res, decisions=dataclasses.replace(
        res.decisions, near_ties=DecisionAgreement(64, 0.95, 0.8, 1, 9, 0.02, 0.005), gap=0.02,
        compared_with="float16", laya_serving=0.78))
    trial._store_verdict(path, art, near)
    assert trial._cached_verdict(path, art) == near
    trial._store_verdict(path, art, res)
    trial._store_verdict(other, twin, res)
    assert trial._cached_verdict(path, art) == res
    for done in _damaged_entries(path, other, "verify"):
        assert _within(10, trial._cached_verdict, path, art) is None, done
    for edit in ({"tolerance": None}, {"tolerance": -1.0}, {"eager_in_dtype": {"max_abs_option_prob": "1"}},
                 {"decisions": {"decisions": 1}}, {"figures": {}}, {"reason": 3}):
        files.write_json_atomic(path, dict(json.loads(other.read_text()), artifact=art.name, **edit))
        assert trial._cached_verdict(path, art) is None, edit


# ------------------------------------------------------------------------------------------------- start costs
def test_a_damaged_start_cost_is_no_figure(cache, sample):
    from laya_aot.runtime import start_costs

    machine = current_machine("cpu")
    art, twin = sample.artifact("onnx-fp32"), sample.artifact("aoti-cpu")
    start_costs.record(art, machine, "cpu", 1.25)
    start_costs.record(twin, machine, "cpu", 3.5)
    path, other = start_costs._path(art, machine, "cpu"), start_costs._path(twin, machine, "cpu")
    assert start_costs.known([art, twin], machine, "cpu") == {"onnx-fp32": 1.25, "aoti-cpu": 3.5}
    for done in _damaged_entries(path, other, "start"):
        got = _within(10, start_costs.known, [art], machine, "cpu")
        if done.split()[0] in ("field_type", "field_missing", "nan") and got:   # the time it was recorded
            assert got == {"onnx-fp32": 1.25}, done
        else:   # another artifact's figure, or no figure a start could take: none (a well-formed 0 s is one)
            assert got == ({"onnx-fp32": 0.0} if done == "poisoned: start_s 0" else {}), (done, got)


# ------------------------------------------------------------------------------------------- TileLang kernels
def test_a_damaged_kernel_cache_entry_is_compiled_again(tmp_path):
    """The build's kernel cache hands a kernel's files back only when both are regular files of a bounded size and
    its record names the kernel's key (a miss compiles it again)."""
    from types import SimpleNamespace

    from laya_aot.kernels.cross_compile import _from_cache

    cache, out = tmp_path / "kernels", tmp_path / "out"
    cache.mkdir()
    out.mkdir()
    spec = SimpleNamespace(key="k1")
    (cache / "k1.so").write_bytes(b"\x7fELF fake library")
    (cache / "k1.json").write_text(json.dumps({"key": "k1", "kernel": "x"}))
    (cache / "k2.json").write_text(json.dumps({"key": "k2", "kernel": "y"}))
    assert _from_cache(spec, cache, out)["cached"] is True
    for entry, other in ((cache / "k1.json", cache / "k2.json"), (cache / "k1.so", cache / "k2.json")):
        for done in _damaged_entries(entry, other, "kernel"):
            got = _within(10, _from_cache, spec, cache, out)
            if done in ("fifo", "dev_zero", "directory", "oversize", "link_to_entry") \
                    or entry.suffix == ".json" and done.split()[0] in ("swapped", "wrong_type", "garbage", "deep"):
                assert got is None, (entry.name, done)
            if got is not None:   # only ever this kernel's record (a library's bytes are the compiler's to judge)
                assert json.loads((out / "k1.json").read_text())["key"] == "k1", (entry.name, done)


# ------------------------------------------------------------------------------------------ tokenizer snapshots
def test_a_damaged_stale_swapped_or_poisoned_tokenizer_snapshot_is_not_used(demo_ckpt, cache):
    """A snapshot is used only when its facts are those derived from the checkpoint's tokenizer files now: a swapped
    id, a pad token past the vocabulary, another tokenizer's size, an older format, any damage: not used (the real
    tokenizer serves and its proven snapshot replaces the entry); what is used answers as transformers does."""
    from transformers import PreTrainedTokenizerFast

    from laya_aot import tokenizer_snapshot as ts

    tok_dir = str(demo_ckpt / "tokenizer")
    real = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    path = ts.store(tok_dir, real)
    stale = path.with_name("stale.json")
    stale.write_text(json.dumps({"format": 1, "backend": real.backend_tokenizer.to_str(), "len": len(real)}))
    texts = ["I was charged twice", "reset [MASK] my password please", "naïve café 🙂 " * 20]
    used = 0
    for done in itertools.chain(_damaged_entries(path, stale, "tokenizer", seed=1), ["as stored"]):
        ts._LOADED.clear()
        tok = _within(20, ts.load, tok_dir, lambda: real)
        if tok is None:
            continue
        used += 1
        assert done == "as stored", done
        for name in ts.SPECIAL:
            assert getattr(tok, name + "_id") == getattr(real, name + "_id"), (done, name)
        for t in texts:
            assert tok(t, add_special_tokens=False)["input_ids"] == real(t, add_special_tokens=False)["input_ids"]
    assert used >= 1


def test_a_snapshot_of_a_larger_tokenizer_is_refused_with_a_message_naming_it(demo_ckpt, cache, tmp_path, caplog):
    """A snapshot swapped in from a larger tokenizer made every call fail with a message blaming the checkpoint:
    now it is refused at load, with a message naming the cache entry, why, and that it is safe to delete."""
    import logging

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from laya_aot import tokenizer_snapshot as ts

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(3000)]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator([" ".join(rng.choices(words, k=40)) for _ in range(500)],
                                trainers.BpeTrainer(vocab_size=2000, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]",
                                                                                    "[MASK]"], show_progress=False))
    big_dir = tmp_path / "big-tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]").save_pretrained(str(big_dir))
    big = PreTrainedTokenizerFast.from_pretrained(str(big_dir))
    tok_dir = str(demo_ckpt / "tokenizer")
    assert len(big) > len(PreTrainedTokenizerFast.from_pretrained(tok_dir))
    _, text = ts.make(str(big_dir), big)
    path = ts._path(ts.key(tok_dir))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    ts._LOADED.clear()
    with caplog.at_level(logging.WARNING, logger="laya_aot.tokenizer_snapshot"):
        assert ts.load(tok_dir, lambda: None) is None
    message = " ".join(r.getMessage() for r in caplog.records)
    assert str(path) in message and "made from another tokenizer" in message and "deleting it is safe" in message
    assert "%d tokens" % len(big) in message


def test_a_bundles_snapshot_is_seeded_only_when_it_matches_the_files(demo_ckpt, cache):
    """What a bundle ships (its key is public: any manifest can carry one for this checkpoint) is checked as any
    entry is before it is written: a pad token past the vocabulary is not seeded."""
    from transformers import PreTrainedTokenizerFast

    from laya_aot import tokenizer_snapshot as ts

    tok_dir = str(demo_ckpt / "tokenizer")
    k, text = ts.make(tok_dir, PreTrainedTokenizerFast.from_pretrained(tok_dir))
    bad = json.loads(text)
    bad["special"]["pad_token_id"] = bad["len"] + 5
    assert "does not match" in ts.seed(tok_dir, k, json.dumps(bad))
    assert not ts._path(k).exists()
    assert ts.seed(tok_dir, k, "[]").startswith("it is not a tokenizer snapshot")
    assert ts.seed(tok_dir, k, text) is None and ts._path(k).read_text() == text


# --------------------------------------------------------------------------------- entries that cannot be written
def _warnings_naming(caplog, path: Path) -> list:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and str(path) in r.getMessage()]


def test_an_entry_that_can_never_be_written_is_one_warning_naming_it_and_the_fix(demo_ckpt, cache, tmp_path, caplog,
                                                                                 monkeypatch):
    """A directory where a digest or a tokenizer snapshot goes was a miss on every start, its work done again, with
    nothing said above INFO: now one warning per process names the entry, the cause and the fix, and the answer
    is still the right one."""
    from transformers import PreTrainedTokenizerFast

    from laya_aot import tokenizer_snapshot as ts

    monkeypatch.setattr(files, "_UNWRITABLE", set(), raising=False)  # a fresh process
    data = tmp_path / "weights.bin"
    data.write_bytes(os.urandom(1 << 16))
    want = files.sha256_file(data)
    digest = cache / "digests" / (hashlib.sha256(files._stat_key(data).encode()).hexdigest() + ".json")
    digest.mkdir(parents=True)
    tok_dir = str(demo_ckpt / "tokenizer")
    real = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    snapshot = ts._path(ts.key(tok_dir))
    snapshot.mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="laya_aot"):
        for _ in range(3):  # three starts' worth in one process
            assert files.cached_sha256(data) == want
            assert ts.store(tok_dir, real) is None
    for entry in (digest, snapshot):
        named = _warnings_naming(caplog, entry)
        assert len(named) == 1, named
        assert "a directory is in its place" in named[0] and "rm -r" in named[0], named[0]
        assert "LAYA_AOT_CACHE_DIR" in named[0], named[0]


def test_a_cache_root_that_is_a_file_is_one_warning_and_answers_stay_right(demo_ckpt, tmp_path, caplog, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    from laya_aot import tokenizer_snapshot as ts

    monkeypatch.setattr(files, "_UNWRITABLE", set(), raising=False)  # a fresh process
    root = tmp_path / "cache"
    root.write_text("not a directory")
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(root))
    data = tmp_path / "weights.bin"
    data.write_bytes(os.urandom(1 << 16))
    tok_dir = str(demo_ckpt / "tokenizer")
    real = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    with caplog.at_level(logging.WARNING, logger="laya_aot"):
        for _ in range(3):
            assert files.cached_sha256(data) == files.sha256_file(data)
            assert ts.store(tok_dir, real) is None
    named = _warnings_naming(caplog, root)  # one per sort of work lost, not one per entry nor per start
    assert len(named) == 2 and {"hashes" in m for m in named} == {True, False}, named
    for m in named:
        assert "%s is a file, not a directory" % root in m and "LAYA_AOT_CACHE_DIR" in m, m
    assert root.read_text() == "not a directory"

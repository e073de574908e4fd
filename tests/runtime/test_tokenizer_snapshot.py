"""The tokenizer snapshot answers exactly as transformers' tokenizer, on tokenizers of several kinds and on texts
it was not checked on when stored; anything else goes to the real tokenizer; a later thin start never imports
transformers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from laya_aot import tokenizer_snapshot as ts

SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
WORDS = ("the invoice was charged twice refund account login error outage payment team billing technical "
         "don't it's we're I'm they've naïve café Zürich 東京 données ñandú").split()
PIECES = [" ", "  ", "\t", "\n", ".", ",", "?", "!", "'", " '", "n't", " 's", "-", "—", "…", "🙂", "\u00a0",
          "[MASK]", "[SEP]", "[PAD]", "12", "3.5", "é", "ß", "Ω", "中", "😀", "\u200b", "<", ">", "/"]
CORPUS = [" ".join(WORDS[i % len(WORDS)] for i in range(k, k + 25)) for k in range(200)]


def _texts(seed: int, n: int):
    """Texts the snapshot's own check never saw: random runs of words, punctuation, scripts and specials."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(int(rng.integers(0, 40))):
            parts.append(WORDS[rng.integers(len(WORDS))] if rng.random() < 0.6 else PIECES[rng.integers(len(PIECES))])
            if rng.random() < 0.5:
                parts.append(" ")
        out.append("".join(parts))
    return out


def _byte_level_bpe() -> Tokenizer:
    """ModernBERT's kind: byte-level BPE, [MASK] stripping the space before it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken("[MASK]", lstrip=True)])
    return tok


def _wordpiece() -> Tokenizer:
    """BERT's kind: lower-cased, accents stripped, word pieces (decode joins with spaces and cleans up)."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=SPECIALS))
    return tok


def _unigram() -> Tokenizer:
    """SentencePiece's kind: unigram pieces with a metaspace."""
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=200, special_tokens=SPECIALS,
                                                            unk_token="[UNK]"))
    return tok


def _saved(tmp_path: Path, backend: Tokenizer, **kwargs) -> Path:
    d = tmp_path / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                            pad_token="[PAD]", mask_token="[MASK]", **kwargs).save_pretrained(str(d))
    return d


def _made(tok_dir: Path):
    real = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    assert ts.store(str(tok_dir), real) is not None
    snap = ts.load(str(tok_dir), lambda: real)
    assert isinstance(snap, ts.SnapshotTokenizer)
    return real, snap


KINDS = {"byte-level BPE": lambda: _byte_level_bpe(), "WordPiece, clean-up on": lambda: _wordpiece(),
         "unigram": lambda: _unigram()}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_snapshot_answers_as_transformers_on_texts_it_was_not_checked_on(tmp_path, kind):
    extra = {"clean_up_tokenization_spaces": True} if "clean-up" in kind else {}
    real, snap = _made(_saved(tmp_path, KINDS[kind](), **extra))
    texts = _texts(sorted(KINDS).index(kind), 300)
    rng = np.random.default_rng(1)
    for t in texts:
        assert dict(snap(t, add_special_tokens=False)) == dict(real(t, add_special_tokens=False)), t
        cut = int(rng.integers(1, 20))
        assert dict(snap(t, add_special_tokens=False, truncation=True, max_length=cut)) == \
            dict(real(t, add_special_tokens=False, truncation=True, max_length=cut)), t
        ids = real(t, add_special_tokens=False)["input_ids"]
        a, b = sorted(int(x) for x in rng.integers(0, len(ids) + 1, size=2))
        assert snap.decode(ids[a:b]) == real.decode(ids[a:b]), (t, a, b)
    assert dict(snap(texts, add_special_tokens=False)) == dict(real(texts, add_special_tokens=False))
    for name in ts.SPECIAL:
        assert getattr(snap, name) == (None if getattr(real, name) is None else str(getattr(real, name)))
        assert getattr(snap, name + "_id") == getattr(real, name + "_id")
    assert len(snap) == len(real)


def test_the_demo_checkpoints_tokenizer(demo_ckpt):
    real, snap = _made(demo_ckpt / "tokenizer")
    for t in _texts(5, 200):
        assert snap(t, add_special_tokens=False)["input_ids"] == real(t, add_special_tokens=False)["input_ids"]


def test_other_calls_go_to_the_real_tokenizer(tmp_path):
    real, snap = _made(_saved(tmp_path, _byte_level_bpe()))
    got = snap(["a refund", "the login error was"], padding=True, return_tensors="pt")
    want = real(["a refund", "the login error was"], padding=True, return_tensors="pt")
    assert type(got) is type(want) and (got["input_ids"] == want["input_ids"]).all()
    assert snap("a refund")["input_ids"] == real("a refund")["input_ids"]   # special tokens added: the real one's
    assert snap.convert_ids_to_tokens([5, 6]) == real.convert_ids_to_tokens([5, 6])


def test_a_pickled_or_copied_snapshot_is_the_real_tokenizer(tmp_path):
    import copy
    import pickle

    real, snap = _made(_saved(tmp_path, _byte_level_bpe()))
    for other in (pickle.loads(pickle.dumps(snap)), copy.deepcopy(snap)):
        assert type(other) is type(real)
        assert other("a refund was charged", add_special_tokens=False)["input_ids"] == \
            snap("a refund was charged", add_special_tokens=False)["input_ids"]


def test_a_tokenizer_it_cannot_reproduce_gets_no_snapshot(tmp_path):
    tok_dir = _saved(tmp_path, _wordpiece())
    real = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))

    class Different:   # what transformers might one day do differently: its decode keeps a marker
        backend_tokenizer = real.backend_tokenizer

        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, *a, **k):
            return real(*a, **k)

        def __len__(self):
            return len(real)

        def decode(self, ids, **k):
            return "<" + real.decode(ids, **k)

    assert ts.store(str(tok_dir), Different()) is None
    assert ts.load(str(tok_dir), lambda: real) is None


def test_an_edited_tokenizer_or_a_damaged_snapshot_is_not_used(tmp_path):
    tok_dir = _saved(tmp_path, _byte_level_bpe())
    real, _ = _made(tok_dir)
    cfg = tok_dir / "tokenizer_config.json"
    cfg.write_text(json.dumps(dict(json.loads(cfg.read_text()), model_max_length=77)))
    assert ts.load(str(tok_dir), lambda: real) is None   # new bytes, new key: the old snapshot is not this one
    path = ts.store(str(tok_dir), real)
    path.write_text("{not json")
    ts._LOADED.clear()
    assert ts.load(str(tok_dir), lambda: real) is None


def _starts(ckpt: Path, bundle: Path, cache: Path, n: int = 2) -> list:
    """`n` fresh processes sharing one laya-aot cache: each loads, answers, and says what tokenised."""
    code = ("import json, sys; import laya_aot; from tests.questions import question_suite, state_text; "
            "import numpy as np; "
            "a = laya_aot.load(sys.argv[1], bundle=sys.argv[2], device='cpu', strict=True); "
            "states = [state_text(np.random.default_rng(3), n) for n in (5, 60, 400)]; "
            "out = a.predict_batch(states, question_suite()); "
            "print(json.dumps({'tok': type(a.tok).__name__, 'transformers': 'transformers' in sys.modules, "
            "'rich': 'rich' in sys.modules, "
            "'shipped': a.backend_object.load_stats.get('tokenizer_snapshot'), "
            "'answers': [o['answers'] for o in out]}))")
    env = dict(os.environ, LAYA_AOT_CACHE_DIR=str(cache),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    return [json.loads(subprocess.run([sys.executable, "-c", code, str(ckpt), str(bundle)], env=env, check=True,
                                      capture_output=True, text=True, timeout=300).stdout.splitlines()[-1])
            for _ in range(n)]


def test_the_bundles_snapshot_serves_the_first_start_on_a_machine(demo_ckpt, demo_bundle, tmp_path):
    """The build ships a proven snapshot in the manifest: a start with an empty cache never imports transformers,
    and answers as a start with the real tokenizer does (the bundle without it, below)."""
    snap = json.loads((demo_bundle / "bundle.json").read_text())["tokenizer_snapshot"]
    assert snap["key"] == ts.key(str(demo_ckpt / "tokenizer")) and len(snap["sha256"]) == 64
    runs = _starts(demo_ckpt, demo_bundle, tmp_path / "cache")
    assert runs[0]["tok"] == "SnapshotTokenizer" and not runs[0]["transformers"]
    assert not runs[0]["rich"]   # nor rich (0.1 s): a start draws no progress lines (`progress` imports it on use)
    assert runs[0]["shipped"] == "the bundle's, stored in this machine's cache"
    assert runs[1] == dict(runs[0], shipped=None)   # the cache has it now: the manifest is not read for it


def _edited(bundle: Path, edit) -> None:
    m = json.loads((bundle / "bundle.json").read_text())
    edit(m)
    (bundle / "bundle.json").write_text(json.dumps(m))


def test_without_the_bundles_snapshot_a_later_thin_start_serves_without_importing_transformers(
        demo_ckpt, bundle_copy, tmp_path):
    _edited(bundle_copy, lambda m: m.pop("tokenizer_snapshot"))   # a bundle built before snapshots were shipped
    runs = _starts(demo_ckpt, bundle_copy, tmp_path / "cache")
    assert runs[0]["tok"] != "SnapshotTokenizer" and runs[0]["transformers"]   # the first start: the real one
    assert runs[0]["shipped"] == "none in the bundle"
    assert runs[1] == dict(runs[0], tok="SnapshotTokenizer", transformers=False, shipped=None)


def test_a_damaged_or_foreign_snapshot_in_the_bundle_is_not_used(demo_ckpt, bundle_copy, tmp_path):
    """Edited text (its sha256 no longer matches) or a key made for other files or versions: the first start loads
    laya's tokenizer itself and answers the same."""
    original = json.loads((bundle_copy / "bundle.json").read_text())["tokenizer_snapshot"]
    reference = _starts(demo_ckpt, bundle_copy, tmp_path / "ref", n=1)[0]
    assert reference["tok"] == "SnapshotTokenizer"

    def damaged(m):
        m["tokenizer_snapshot"]["text"] = original["text"].replace('"len": ', '"len": 1', 1)

    _edited(bundle_copy, damaged)
    run = _starts(demo_ckpt, bundle_copy, tmp_path / "damaged", n=1)[0]
    assert run["shipped"] == "the bundle's did not match its sha256; not used"
    assert run["tok"] != "SnapshotTokenizer" and run["answers"] == reference["answers"]

    def foreign(m):
        m["tokenizer_snapshot"] = dict(original, key="0" * 64)

    _edited(bundle_copy, foreign)
    run = _starts(demo_ckpt, bundle_copy, tmp_path / "foreign", n=1)[0]
    assert run["shipped"].startswith("the bundle's not used: it was made for other tokenizer files")
    assert run["tok"] != "SnapshotTokenizer" and run["answers"] == reference["answers"]


def test_a_bundles_snapshot_with_a_pad_token_past_the_vocabulary_seeds_nothing(demo_ckpt, bundle_copy, tmp_path):
    """An unpinned bundle's snapshot whose pad_token_id is past the vocabulary, its sha256 recomputed: it aborted
    the start inside an AOTInductor kernel and, stored in the cache, every later start of the pristine bundle.
    Now it is checked against the checkpoint's tokenizer files before it is seeded: not seeded, and every start
    answers as laya does."""
    from laya_aot.manifest import text_digest

    reference = _starts(demo_ckpt, bundle_copy, tmp_path / "ref", n=1)[0]
    original = json.loads((bundle_copy / "bundle.json").read_text())["tokenizer_snapshot"]
    bad = json.loads(original["text"])
    bad["special"]["pad_token_id"] = bad["len"] + 5

    def poisoned(m):
        m["tokenizer_snapshot"] = dict(original, text=json.dumps(bad), sha256=text_digest(json.dumps(bad)))

    _edited(bundle_copy, poisoned)
    cache = tmp_path / "cache"
    first, later = _starts(demo_ckpt, bundle_copy, cache)
    assert first["shipped"].startswith("the bundle's not used: it does not match this checkpoint's tokenizer files")
    assert first["answers"] == reference["answers"] and later["answers"] == reference["answers"]
    assert later["tok"] == "SnapshotTokenizer"   # proven here against laya's own tokenizer by the first start
    assert json.loads(next((cache / "tokenizers").iterdir()).read_text())["special"]["pad_token_id"] == \
        json.loads(original["text"])["special"]["pad_token_id"]


def test_a_refused_bundle_seeds_nothing(demo_ckpt, demo_bundle, tmp_path, monkeypatch):
    """A bundle built from another checkpoint (here: the demo's weights with one bit changed, the same tokenizer
    files) is judged before its snapshot is considered: nothing is seeded, and the start says why."""
    import shutil

    import laya_aot

    ckpt = tmp_path / "ckpt"
    shutil.copytree(demo_ckpt, ckpt)
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4] ^= 1   # the lowest bit of the last weight
    weights.write_bytes(bytes(data))
    assert ts.key(str(ckpt / "tokenizer")) == json.loads((demo_bundle / "bundle.json").read_text())[
        "tokenizer_snapshot"]["key"]   # the snapshot's key is this checkpoint's: only the judgement stops it
    seeded = []
    monkeypatch.setattr(ts, "seed", lambda *a: seeded.append(a))
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(ts, "_LOADED", {})
    with pytest.warns(RuntimeWarning, match="built from"):
        agent = laya_aot.load(str(ckpt), bundle=str(demo_bundle), device="cpu")
    assert agent.backend == "eager" and not seeded
    assert agent.backend_object.stats["tokenizer_snapshot"].startswith("the bundle's not used: the bundle was ")

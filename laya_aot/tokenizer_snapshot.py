"""laya's tokenizer without importing transformers: a snapshot of it, proven equal on this machine.

A thin start needs laya's tokenizer, and `from transformers import PreTrainedTokenizerFast` alone costs
0.5-0.7 s of every start (transformers scans its whole model tree to build its lazy import table), a
quarter of a CPU start and time that competes with the artifact's load for the GIL. What laya's serving
path asks of its tokenizer is small: `tok(text or texts, add_special_tokens=False[, truncation=True,
max_length=N])["input_ids"]`, `tok.decode(ids)`, the special tokens and their ids, and `len(tok)`.

So the first start on a machine loads the real tokenizer (laya's path) and stores a snapshot of it in the
per-machine cache: the Rust backend exactly as transformers set it up (`to_str()`, with its added tokens and
flags), the special tokens, and how its `decode` cleans up. The snapshot is written only after it gave the
real tokenizer's answers on a fixed set of texts (encode one and many, truncated, decode of whole and cut id
lists), and it is keyed by the tokenizer directory's bytes and the versions of transformers, tokenizers and
laya, so an upgrade or an edited tokenizer makes a new one. Later starts build `SnapshotTokenizer` from it
with `tokenizers` alone. Anything it does not answer itself (other keyword arguments, `save_pretrained`,
tensors) goes to the real tokenizer, loaded on first such use.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .files import cache_dir, cached_sha256, sha256_tree, write_bytes_atomic

log = logging.getLogger(__name__)

FORMAT = 1
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_VERSIONED = ("transformers", "tokenizers", "laya")
_LOCK = threading.Lock()
_LOADED: Dict[str, "SnapshotTokenizer"] = {}  # one per snapshot key per process, like laya's own cache
_REFUSED: set = set()  # keys whose tokenizer the snapshot cannot reproduce: checked once per process
_OWN = frozenset(("_backend", "_special", "_len", "_cleanup", "_names", "_right", "_load_real", "_real",
                  "_real_lock"))

# The texts a snapshot must answer exactly as the real tokenizer before it is stored: words, punctuation that
# transformers' clean-up rewrites, whitespace runs, accents, scripts, emoji, control characters, the special
# tokens inside text, and a text long enough to be cut at 48 tokens.
_CHECK_TEXTS = (
    "", " ", "I was charged twice for the March invoice", "Which team should handle this?",
    "Hello , world . Is n't it ? Yes ! I 'm sure , they 're here and we 've seen it 's fine ' ok ' .",
    "  leading and trailing spaces  ", "tabs\tand\nnew lines\r\n  mixed", "naïve café — déjà vu, Ærøskøbing",
    "日本語のテキストと中文文本", "emoji 🙂👍🏽 and symbols ©®™ €100 ½",
    "[CLS] [SEP] [PAD] [MASK] [UNK] <s> </s> <pad> <mask> <unk> inside a sentence",
    "UPPER lower MiXeD 12345 3.14159 1e-9 user@example.com https://example.com/a?b=c#d",
    " ".join("word%d" % i for i in range(120)),
    "\u200b zero width \u00a0 no-break \ufeff bom",
)


@functools.lru_cache(maxsize=1)
def _versions() -> Dict[str, str]:
    out = {}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def key(tok_dir: str) -> Optional[str]:
    """The snapshot's name: the tokenizer directory's files (names and bytes; digests cached per file like the
    loader's) and the library versions."""
    try:
        files = sha256_tree(tok_dir, file_digest=cached_sha256)
    except OSError:
        return None
    facts = {"format": FORMAT, "versions": _versions(), "files": files}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def _path(k: str) -> Path:
    return cache_dir() / "tokenizers" / ("%s.json" % k)


def _clean_up(text: str) -> str:
    """transformers' `clean_up_tokenization` (used where the real decode applies it; the check proves which)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class Encoded(dict):
    """What the real tokenizer's call returns for these inputs (a BatchEncoding's keys), read as keys or names."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class SnapshotTokenizer:
    """laya's tokenizer answered from a stored snapshot (module docstring); the real one on anything else."""

    def __init__(self, snap: Dict[str, Any], load_real: Callable[[], Any]):
        from tokenizers import Tokenizer

        self._backend = Tokenizer.from_str(snap["backend"])
        self._backend.no_truncation()
        self._backend.no_padding()
        self._backend.encode_special_tokens = bool(snap["encode_special_tokens"])
        self._special: Dict[str, Any] = dict(snap["special"])
        self._len = int(snap["len"])
        self._cleanup = bool(snap["decode_cleanup"])
        self._names: List[str] = list(snap["model_input_names"])
        self._right = snap["truncation_side"] == "right"
        self._load_real, self._real, self._real_lock = load_real, None, threading.Lock()

    # what laya's serving path reads
    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in _OWN:  # never recurse through a half-made (copied) object
            raise AttributeError(name)
        special = self.__dict__.get("_special", {})
        if name in special:
            return special[name]
        return getattr(self.real(), name)

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        plain = None if args else self._plain_call(text, kwargs)
        if plain is None:  # a text pair, padding, tensors, special tokens added: the real tokenizer's call
            return self.real()(text, *args, **kwargs)
        single = isinstance(text, str)
        encs = self._backend.encode_batch([text] if single else list(text), add_special_tokens=False)
        out = Encoded()
        for name in self._names:
            rows = [self._field(e, name, plain) for e in encs]
            if rows and rows[0] is not None:
                out[name] = rows[0] if single else rows
        return out

    def decode(self, token_ids: Any, **kwargs: Any) -> str:
        if kwargs or not isinstance(token_ids, (list, tuple)) or not all(type(t) is int for t in token_ids):
            return self.real().decode(token_ids, **kwargs)
        text = self._backend.decode(list(token_ids), skip_special_tokens=False)
        return _clean_up(text) if self._cleanup else text

    def __reduce__(self) -> Any:
        """Pickled or deep-copied (an agent sent to another process): as the real tokenizer, which pickles."""
        return (_same, (self.real(),))

    def real(self) -> Any:
        """The transformers tokenizer this snapshot was made from (imports transformers on first use)."""
        with self._real_lock:
            if self._real is None:
                log.info("laya-aot: loading the full tokenizer for a call the snapshot does not answer")
                self._real = self._load_real()
            return self._real

    def _plain_call(self, text: Any, kwargs: Dict[str, Any]) -> Optional[int]:
        """The token cap of a call this snapshot answers (0: none), or None for any other call."""
        if not (isinstance(text, str) or (isinstance(text, (list, tuple)) and text
                                          and all(isinstance(t, str) for t in text))):
            return None
        if kwargs.get("add_special_tokens", True) is not False or not self._right:
            return None
        rest = {k: v for k, v in kwargs.items() if k != "add_special_tokens"}
        if not rest:
            return 0
        if set(rest) == {"truncation", "max_length"} and rest["truncation"] is True \
                and type(rest["max_length"]) is int and rest["max_length"] > 0:
            return rest["max_length"]
        return None

    @staticmethod
    def _field(enc: Any, name: str, cut: int) -> Optional[List[int]]:
        vals = {"input_ids": enc.ids, "attention_mask": enc.attention_mask, "token_type_ids": enc.type_ids}.get(name)
        if vals is None:
            return None
        return list(vals[:cut]) if cut else list(vals)


def _same(obj: Any) -> Any:
    return obj


def _snapshot_of(real: Any) -> Dict[str, Any]:
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(real.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    special = {}
    for name in SPECIAL:
        tok = getattr(real, name, None)
        special[name] = None if tok is None else str(tok)
        special[name + "_id"] = None if tok is None else getattr(real, name + "_id", None)
    return {"format": FORMAT, "backend": backend.to_str(), "special": special, "len": len(real),
            "encode_special_tokens": bool(getattr(real, "split_special_tokens", False)),
            "model_input_names": [n for n in getattr(real, "model_input_names", ["input_ids"])
                                  if n in ("input_ids", "attention_mask", "token_type_ids")],
            "truncation_side": getattr(real, "truncation_side", "right"), "decode_cleanup": False}


def _differences(snap_tok: SnapshotTokenizer, real: Any, texts: Sequence[str]) -> List[str]:
    """Where the snapshot's answers differ from the real tokenizer's (empty: equal on every check)."""
    bad = []
    for t in texts:
        for kw in ({"add_special_tokens": False}, {"add_special_tokens": False, "truncation": True, "max_length": 48}):
            if dict(snap_tok(t, **kw)) != dict(real(t, **kw)):
                bad.append("encode %r %s" % (t[:30], kw))
        ids = real(t, add_special_tokens=False)["input_ids"]
        for cut in (ids, ids[1:], ids[:-1], ids[len(ids) // 3: 2 * len(ids) // 3 + 1]):
            if snap_tok.decode(cut) != real.decode(cut):
                bad.append("decode of %r" % t[:30])
    many = list(texts)
    if dict(snap_tok(many, add_special_tokens=False)) != dict(real(many, add_special_tokens=False)):
        bad.append("batch encode")
    for name in SPECIAL:
        if getattr(snap_tok, name) != (None if getattr(real, name, None) is None else str(getattr(real, name))) \
                or getattr(snap_tok, name + "_id") != getattr(real, name + "_id", None):
            bad.append(name)
    if len(snap_tok) != len(real):
        bad.append("len")
    return bad


def make(tok_dir: str, real: Any) -> Optional[Tuple[str, str]]:
    """The snapshot of `real` (laya's tokenizer for `tok_dir`) as (key, JSON text) when it answers as `real` does
    on every check, else None (logged). What the machine cache stores and what a build ships in its bundle."""
    k = key(tok_dir)
    if k is None or k in _REFUSED or not hasattr(real, "backend_tokenizer"):
        return None
    try:
        snap = _snapshot_of(real)
        specials = [v for n, v in snap["special"].items() if not n.endswith("_id") and v]
        texts = list(_CHECK_TEXTS) + [" ".join(specials)]
        for cleanup in (False, True):  # which decode the real one does is found, not assumed per version
            snap["decode_cleanup"] = cleanup
            bad = _differences(SnapshotTokenizer(snap, lambda: real), real, texts)
            if not bad:
                return k, json.dumps(snap)
        _REFUSED.add(k)
        log.info("laya-aot: no tokenizer snapshot for %s (it differs from transformers' on %s)",
                 tok_dir, ", ".join(bad[:3]))
    except Exception as e:  # noqa: BLE001 - a snapshot is an optimisation; the real tokenizer serves regardless
        log.info("laya-aot: no tokenizer snapshot for %s: %s: %s", tok_dir, type(e).__name__, e)
    return None


def store(tok_dir: str, real: Any) -> Optional[Path]:
    """Snapshot `real` (laya's tokenizer for `tok_dir`) into the machine cache if it answers as `real` does.

    Best effort: a tokenizer the snapshot cannot reproduce, or a cache that cannot be written, only means the
    next start loads the real tokenizer again. Returns the file written, or None."""
    made = make(tok_dir, real)
    return None if made is None else _write(*made)


def cached(tok_dir: str) -> bool:
    """Whether this machine's cache holds a snapshot for `tok_dir` as it is now, with these library versions."""
    k = key(tok_dir)
    return k is not None and (k in _LOADED or _path(k).is_file())


def seed(tok_dir: str, snap_key: str, text: str) -> Optional[str]:
    """Put a snapshot a build made (a bundle's, `manifest.TokenizerSnapshot`) into this machine's cache, so that
    the first start here reads it instead of importing transformers. It is used only under the key it was
    proven under: the same tokenizer files and the same transformers, tokenizers and laya versions as here
    (the check ran against those on the build machine; tokenizers' answers do not depend on the machine).
    Returns why it was not used (None: the cache holds it now)."""
    here = key(tok_dir)
    if here is None:
        return "the checkpoint has no readable tokenizer directory"
    if here != snap_key:
        return ("it was made for other tokenizer files or other transformers/tokenizers/laya versions than "
                "these (%s)" % ", ".join("%s %s" % kv for kv in sorted(_versions().items())))
    if _path(here).is_file():
        return None
    # stored as it is: `load` reads it next (once), and treats an unreadable entry as none (the real tokenizer)
    return None if _write(here, text) is not None else "this machine's laya-aot cache cannot be written"


def _write(k: str, text: str) -> Optional[Path]:
    try:
        path = _path(k)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, text.encode("utf-8"))
        return path
    except OSError as e:
        log.info("laya-aot: tokenizer snapshot not stored: %s", e)
        return None


def load(tok_dir: str, load_real: Callable[[], Any]) -> Optional[SnapshotTokenizer]:
    """The snapshot tokenizer for `tok_dir` when this machine stored one for these exact files and versions."""
    k = key(tok_dir)
    if k is None:
        return None
    with _LOCK:
        if k in _LOADED:
            return _LOADED[k]
        try:
            snap = json.loads(_path(k).read_bytes())
            if not isinstance(snap, dict) or snap.get("format") != FORMAT:
                return None
            tok = SnapshotTokenizer(snap, load_real)
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - a damaged cache entry costs one real load, never the start
            log.info("laya-aot: tokenizer snapshot %s not used: %s: %s", _path(k), type(e).__name__, e)
            return None
        _LOADED[k] = tok
        return tok

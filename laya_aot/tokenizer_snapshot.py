"""laya's tokenizer without importing transformers: the checkpoint's tokenizer files read directly, proven equal.

A thin start needs laya's tokenizer, and `from transformers import PreTrainedTokenizerFast` alone costs
0.5-0.7 s of every start (transformers scans its whole model tree to build its lazy import table), a
quarter of a CPU start and time that competes with the artifact's load for the GIL. What laya's serving
path asks of its tokenizer is small: `tok(text or texts, add_special_tokens=False[, truncation=True,
max_length=N])["input_ids"]`, `tok.decode(ids)`, the special tokens and their ids, and `len(tok)`.

`derive` answers those from the checkpoint's tokenizer files alone, with `tokenizers`: the Rust backend from
tokenizer.json, the special tokens and settings from tokenizer_config.json and special_tokens_map.json as
transformers reads them, each special token's id from that backend. Whether that is exactly transformers'
tokenizer is proven once per machine (or by the build): the first start loads the real tokenizer (laya's path)
and `make` checks the derived one against it (the same backend, the same facts, the same answers on a fixed set
of texts: encode one and many, truncated, decode of whole and cut id lists). Only then is a snapshot stored in
the per-machine cache, keyed by the tokenizer directory's bytes and the versions of transformers, tokenizers and
laya. It holds the derived facts (no vocabulary): a later start derives them again from the files, and uses the
derived tokenizer only when they match the snapshot's. So the cache vouches only that the proof ran for these
files; what is used comes from the files, and a snapshot of another tokenizer, a swapped id or a special token
out of range (an edited entry, or one a bundle shipped) is refused with a message naming the entry, and the
real tokenizer serves that start and replaces it. Anything `SnapshotTokenizer` does not answer itself (other
keyword arguments, `save_pretrained`, tensors) goes to the real tokenizer, loaded on first such use.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from .files import cache_dir, cached_sha256, parse_cache_json, read_cache_json, sha256_tree, write_cache_entry

log = logging.getLogger(__name__)

FORMAT = 2  # 2: the facts derived from the files, no backend (1 stored the backend itself)
# a snapshot holds a few hundred bytes of facts; anything much larger is not one
MAX_SNAPSHOT_BYTES = 64 << 10
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_VERSIONED = ("transformers", "tokenizers", "laya")
_LOCK = threading.Lock()
_LOADED: Dict[str, "SnapshotTokenizer"] = {}  # one per snapshot key per process, like laya's own cache
_REFUSED: set = set()  # keys whose tokenizer the snapshot cannot reproduce: checked once per process
_OWN = frozenset(("_backend", "_special", "_len", "_cleanup", "_names", "_right", "_load_real", "_real",
                  "_real_lock", "_source"))
_NAMES = ("input_ids", "attention_mask", "token_type_ids")  # the fields of a call the snapshot answers
# transformers' own defaults for what tokenizer_config.json leaves out (PreTrainedTokenizerBase); a transformers
# with others gets no snapshot (`make` finds the difference) until these follow it
_DEFAULT_INPUT_NAMES = ["input_ids", "attention_mask"]

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
    """laya's tokenizer answered from the checkpoint's tokenizer files (`derive`, proven by a snapshot: module
    docstring); the real one on anything else."""

    def __init__(self, derived: "Derived", load_real: Callable[[], Any], source: Optional[Path] = None):
        facts = derived.facts
        self._backend = derived.backend
        self._special: Dict[str, Any] = dict(facts["special"])
        # laya reads some on every call (mask_token, sep_token_id, pad_token_id): instance attributes are found
        # without the failed lookup that precedes __getattr__ (the same values, read the same way)
        self.__dict__.update((n, v) for n, v in self._special.items() if not hasattr(type(self), n))
        self._len = int(facts["len"])
        self._cleanup = bool(facts["decode_cleanup"])
        self._names: List[str] = list(facts["model_input_names"])
        self._right = facts["truncation_side"] == "right"
        self._source = source  # the cache entry it was checked against (None: made here)
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


class Derived(NamedTuple):
    """What `derive` reads from a checkpoint's tokenizer files: the backend and the facts a snapshot records."""

    backend: Any  # tokenizers.Tokenizer, no truncation or padding, special tokens encoded as the config says
    facts: Dict[str, Any]


class Underivable(ValueError):
    """The tokenizer files say something `derive` does not read as transformers does: no snapshot for them."""


def _json_file(path: str, missing: Any) -> Any:
    if not os.path.exists(path):
        return missing
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _content(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json or special_tokens_map.json spell it: a string or an AddedToken's."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise Underivable("a special token written as %.60r" % (value,))


def derive(tok_dir: str) -> Derived:
    """The tokenizer laya's serving path needs, read from the files in `tok_dir` alone (module docstring), as
    transformers' fast tokenizer reads them; raises Underivable (or OSError, ValueError) where it cannot."""
    from tokenizers import Tokenizer

    config = _json_file(os.path.join(tok_dir, "tokenizer_config.json"), {})
    named = _json_file(os.path.join(tok_dir, "special_tokens_map.json"), {})  # transformers: this one wins
    if not isinstance(config, dict) or not isinstance(named, dict):
        raise Underivable("tokenizer_config.json or special_tokens_map.json is not a JSON object")
    backend = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    backend.no_truncation()
    backend.no_padding()
    special: Dict[str, Any] = {}
    for name in SPECIAL:
        tok = _content(named[name] if name in named else config.get(name))
        tid = None if tok is None else backend.token_to_id(tok)
        if tok is not None and tid is None:  # transformers adds it to the vocabulary
            raise Underivable("its %s %r is not in tokenizer.json's vocabulary" % (name, tok))
        special[name], special[name + "_id"] = tok, tid
    split = config.get("split_special_tokens", False)
    side = config.get("truncation_side", "right")
    names = config.get("model_input_names", _DEFAULT_INPUT_NAMES)
    cleanup = config.get("clean_up_tokenization_spaces", False)
    force = config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    if not (type(split) is bool and side in ("left", "right") and type(cleanup) is bool and type(force) is bool
            and isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise Underivable("a setting of tokenizer_config.json of another type than transformers reads")
    if cleanup and type(backend.model).__name__ == "BPE" and not force:
        cleanup = False  # transformers' decode skips its clean-up for a BPE model unless forced
    backend.encode_special_tokens = split
    return Derived(backend, {"special": special, "len": backend.get_vocab_size(with_added_tokens=True),
                             "encode_special_tokens": split, "truncation_side": side, "decode_cleanup": cleanup,
                             "model_input_names": [n for n in names if n in _NAMES]})


def _special_record(value: Any) -> bool:
    ok = isinstance(value, dict) and set(value) == {n + s for n in SPECIAL for s in ("", "_id")}
    return ok and all(value[n] is None or isinstance(value[n], str) for n in SPECIAL) and \
        all(value[n + "_id"] is None or type(value[n + "_id"]) is int for n in SPECIAL)


# a snapshot as stored: every fact typed (files.read_cache_json), the format this laya-aot writes
_FIELDS = {"format": lambda v: type(v) is int and v == FORMAT, "special": _special_record,
           "len": lambda v: type(v) is int and v >= 0, "encode_special_tokens": bool, "decode_cleanup": bool,
           "truncation_side": str, "model_input_names": lambda v: isinstance(v, list) and
           all(isinstance(n, str) for n in v)}


def _facts_of(real: Any) -> Dict[str, Any]:
    """The facts of transformers' tokenizer `real` that `derive` reads from the files (the clean-up of its decode
    is found by the check texts instead)."""
    special: Dict[str, Any] = {}
    for name in SPECIAL:
        tok = getattr(real, name, None)
        special[name] = None if tok is None else str(tok)
        special[name + "_id"] = None if tok is None else getattr(real, name + "_id", None)
    return {"special": special, "len": len(real), "encode_special_tokens": bool(getattr(real, "split_special_tokens",
                                                                                        False)),
            "truncation_side": getattr(real, "truncation_side", "right"),
            "model_input_names": [n for n in getattr(real, "model_input_names", ["input_ids"]) if n in _NAMES]}


def _mismatch(stored: Dict[str, Any], facts: Dict[str, Any]) -> Optional[str]:
    """How a snapshot's facts differ from those derived from the files now (None: they do not)."""
    if stored["len"] != facts["len"]:
        return ("it has %d tokens and the checkpoint's tokenizer files %d: it was made from another tokenizer"
                % (stored["len"], facts["len"]))
    for name in SPECIAL:
        mine, theirs = stored["special"], facts["special"]
        if (mine[name], mine[name + "_id"]) != (theirs[name], theirs[name + "_id"]):
            return ("its %s is %.40r (id %s), the checkpoint's tokenizer files say %.40r (id %s)"
                    % (name, mine[name], mine[name + "_id"], theirs[name], theirs[name + "_id"]))
    for name in ("encode_special_tokens", "truncation_side", "decode_cleanup", "model_input_names"):
        if stored[name] != facts[name]:
            return "its %s is %.40r, the checkpoint's tokenizer files give %.40r" % (name, stored[name], facts[name])
    return None


def _backend_of(real: Any, encode_special_tokens: bool) -> str:
    """transformers' backend as a call the snapshot answers runs it (no truncation or padding), serialised."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(real.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = encode_special_tokens
    return backend.to_str()


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
    """The snapshot of `real` (laya's tokenizer for `tok_dir`) as (key, JSON text) when the tokenizer `derive` reads
    from the files is `real`'s (the same backend and facts, the same answers on every check), else None (logged).
    What the machine cache stores and what a build ships in its bundle."""
    k = key(tok_dir)
    if k is None or k in _REFUSED or not hasattr(real, "backend_tokenizer"):
        return None
    try:
        try:
            derived = derive(tok_dir)
        except (Underivable, OSError, ValueError) as e:
            bad = ["its files (%s)" % e]
        else:
            facts = dict(derived.facts)
            bad = [name for name, value in _facts_of(real).items() if facts[name] != value]
            if not bad and _backend_of(real, facts["encode_special_tokens"]) != derived.backend.to_str():
                bad.append("the backend (transformers changed what tokenizer.json says)")
            if not bad:
                specials = [v for n, v in facts["special"].items() if not n.endswith("_id") and v]
                bad = _differences(SnapshotTokenizer(derived, lambda: real), real,
                                   list(_CHECK_TEXTS) + [" ".join(specials)])
            if not bad:
                return k, json.dumps(dict(facts, format=FORMAT))
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
    proven under (the same tokenizer files and the same transformers, tokenizers and laya versions as here: the
    check ran against those on the build machine; tokenizers' answers do not depend on the machine) and only
    when its facts are those derived from the files here (`_checked`). Returns why it was not used (None: the
    cache holds it now)."""
    here = key(tok_dir)
    if here is None:
        return "the checkpoint has no readable tokenizer directory"
    if here != snap_key:
        return ("it was made for other tokenizer files or other transformers/tokenizers/laya versions than "
                "these (%s)" % ", ".join("%s %s" % kv for kv in sorted(_versions().items())))
    if _path(here).is_file():
        return None
    data = text.encode("utf-8")
    stored = parse_cache_json(data, _FIELDS, "the bundle's tokenizer snapshot") \
        if len(data) <= MAX_SNAPSHOT_BYTES else None
    if stored is None:
        return "it is not a tokenizer snapshot this laya-aot reads (format %d)" % FORMAT
    checked = _checked(tok_dir, stored, "the bundle's tokenizer snapshot", lambda: None)
    if checked is None:
        return "it does not match this checkpoint's tokenizer files (the log says how)"
    return None if _write(here, text) is not None else "this machine's laya-aot cache cannot be written"


def _checked(tok_dir: str, stored: Dict[str, Any], source: Any, load_real: Callable[[], Any]
             ) -> Optional[SnapshotTokenizer]:
    """The tokenizer derived from the files now, when its facts are the snapshot's `stored` ones (None, logged:
    they are not, or the files cannot be derived from any more)."""
    try:
        derived = derive(tok_dir)
    except (Underivable, OSError, ValueError) as e:
        log.info("laya-aot: tokenizer snapshot %s not used: the tokenizer files cannot be read as it was proven "
                 "on (%s)", source, e)
        return None
    why = _mismatch(stored, derived.facts)
    if why is not None:
        log.warning("laya-aot: tokenizer snapshot %s does not match the checkpoint's tokenizer files in %s (%s); not "
                    "used: laya's own tokenizer serves, and a snapshot proven against it replaces this one (an "
                    "edited or swapped entry: deleting it is safe)", source, tok_dir, why)
        return None
    return SnapshotTokenizer(derived, load_real, source if isinstance(source, Path) else None)


def _write(k: str, text: str) -> Optional[Path]:
    """Store a snapshot; None where the cache cannot take it (`files.write_cache_entry` warns once, naming why)."""
    path = _path(k)
    return path if write_cache_entry(path, text.encode("utf-8"), "every start imports transformers to read the "
                                     "tokenizer") else None


def load(tok_dir: str, load_real: Callable[[], Any]) -> Optional[SnapshotTokenizer]:
    """The tokenizer derived from `tok_dir`'s files when this machine proved it for these exact files and versions
    (its snapshot, checked against them: `_checked`); None: laya's own tokenizer serves."""
    k = key(tok_dir)
    if k is None:
        return None
    with _LOCK:
        if k in _LOADED:
            return _LOADED[k]
        path = _path(k)
        stored = read_cache_json(path, _FIELDS, MAX_SNAPSHOT_BYTES)
        if stored is None:
            return None
        tok = _checked(tok_dir, stored, path, load_real)
        if tok is not None:
            _LOADED[k] = tok
        return tok

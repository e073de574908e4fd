"""Ways a per-machine cache entry goes wrong, for the cache tests (test_cache_entries.py, test_cache_fuzz.py).

Each one replaces the entry at a path and never writes into the file it finds there: a fuzz case's cache is a
hard-linked copy of a warm one, whose files must stay as they are.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Optional

# what a disk, a crash, another tool or a person leaves where an entry was
GENERIC = ("empty", "truncated", "garbage", "wrong_type", "deep", "nan", "fifo", "dev_zero", "directory",
           "oversize", "link_to_entry", "field_type", "field_missing", "swapped")


def _old(path: Path) -> bytes:
    """What the entry holds now, when it is a regular file of a size an entry has (else nothing)."""
    try:
        if not path.is_file() or path.is_symlink() or path.stat().st_size > (16 << 20):
            return b""
        return path.read_bytes()
    except OSError:
        return b""


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _json(data: bytes) -> Optional[Dict[str, Any]]:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _other_type(value: Any, rng: random.Random) -> Any:
    """A JSON value of another type than `value` (bool and int count as different)."""
    choices = [None, True, 0, -1, 2.5, "x", "", [], [1, "a"], {}, {"content": 1}]
    return rng.choice([c for c in choices if type(c) is not type(value)])


def damage(path: Path, how: str, rng: random.Random, other: Optional[Path] = None) -> str:
    """Replace the entry at `path` as `how` says (one of GENERIC); `other`: another entry of the same kind (for
    "swapped" and "link_to_entry"). Returns what was done, in a few words."""
    data = _old(path)
    record = _json(data)
    _remove(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if how == "fifo":
        os.mkfifo(path)
    elif how == "dev_zero":
        os.symlink("/dev/zero", path)
    elif how == "directory":
        path.mkdir()
        (path / "inside.json").write_text("{}")
    elif how == "oversize":
        with open(path, "wb") as f:
            f.truncate(2 << 30)   # sparse: 2 GiB that no read must take
    elif how == "link_to_entry" and other is not None:
        os.symlink(other, path)
    elif how == "swapped" and other is not None and other.is_file():
        path.write_bytes(other.read_bytes())
    elif how in ("field_type", "field_missing") and record:
        name = rng.choice(sorted(record))
        if how == "field_missing":
            del record[name]
        else:
            record[name] = _other_type(record[name], rng)
        path.write_text(json.dumps(record))
        return "%s %s" % (how, name)
    elif how == "nan" and record:
        name = rng.choice(sorted(record))
        record[name] = float(rng.choice(["nan", "inf", "-inf"]))
        path.write_text(json.dumps(record))   # NaN / Infinity: JSON to Python's json, not to the entry's reader
        return "nan %s" % name
    elif how == "wrong_type":
        path.write_text(json.dumps(rng.choice([[], "x", 3, None, True, 2.5, [1, 2], {"a": 1}])))
    elif how == "deep":
        path.write_bytes(b"[" * 200_000)
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    else:  # garbage (and what cannot apply to this entry: no record, no other entry)
        path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))))
        return "garbage"
    return how


# in-domain but wrong values, per kind of entry: what an edit or a hostile bundle would write
def _poison_tokenizer(rec: Dict[str, Any], rng: random.Random) -> str:
    special = rec.get("special")
    way = rng.choice(["swap_ids", "pad_out_of_range", "larger", "flags", "names", "side", "token_text"])
    if way in ("swap_ids", "pad_out_of_range", "token_text") and isinstance(special, dict):
        ids = [n for n in special if n.endswith("_id") and isinstance(special[n], int)]
        if way == "swap_ids" and len(ids) >= 2:
            a, b = rng.sample(ids, 2)
            special[a], special[b] = special[b], special[a]
        elif way == "pad_out_of_range":
            special["pad_token_id"] = int(rec.get("len", 1000)) + rng.choice([0, 1, 7, 100_000])
        else:
            special["mask_token"] = "[CLS]"
        return way
    if way == "larger":
        rec["len"] = int(rec.get("len", 0)) + rng.choice([1, 1000, 50_000])
    elif way == "flags":
        for name in ("decode_cleanup", "encode_special_tokens"):
            rec[name] = not rec.get(name)
    elif way == "names":
        rec["model_input_names"] = rng.choice([[], ["attention_mask"], ["token_type_ids", "input_ids"]])
    else:
        rec["truncation_side"] = "left"
    return way


def _poison_verdict(rec: Dict[str, Any], rng: random.Random) -> str:
    way = rng.choice(["failed", "graphs", "other_artifact", "other_sha256"])
    if way == "failed":
        rec["reason"] = "a probe process that loaded it exited with status 1"
    elif way == "graphs":
        rec["graphs"] = "no graph was captured"
    elif way == "other_artifact":
        rec["artifact"] = "some-other-artifact"
    else:
        rec["sha256"] = "0" * 64
    return way


def _poison_start(rec: Dict[str, Any], rng: random.Random) -> str:
    rec["start_s"] = rng.choice([-1, 1e300, 0, 1e6, "1.5", True])
    return "start_s %r" % (rec["start_s"],)


def _poison_digest(rec: Dict[str, Any], rng: random.Random) -> str:
    name = next((k for k in rec if k != "path"), "sha256")
    if rng.random() < 0.5:
        rec[name] = "%064x" % rng.getrandbits(256)   # another file's digest: the file reads as changed
        return "another digest"
    rec["path"] = "/somewhere/else"
    return "another path"


POISON: Dict[str, Callable[[Dict[str, Any], random.Random], str]] = {
    "tokenizer": _poison_tokenizer, "verdict": _poison_verdict, "start": _poison_start, "digest": _poison_digest}


def kind_of(path: Path, root: Path) -> str:
    """The kind of cache entry at `path` under cache root `root`: digest, tokenizer, verdict, start, pack, other."""
    top = path.relative_to(root).parts[0]
    if top == "digests":
        return "digest"
    if top == "tokenizers":
        return "tokenizer"
    if top == "packs":
        return "pack"
    if top == "probes":
        return "start" if b'"start_s"' in _old(path) else "verdict"
    return "other"


def poison(path: Path, kind: str, rng: random.Random) -> str:
    """Rewrite a JSON entry with a wrong value of the right type (POISON for its kind); "garbage" where none fits."""
    rec = _json(_old(path))
    if rec is None or kind not in POISON:
        return damage(path, "garbage", rng)
    way = POISON[kind](rec, rng)
    _remove(path)
    path.write_text(json.dumps(rec))
    return "poisoned: %s" % way

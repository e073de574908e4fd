"""Hashing, atomic writes and the per-machine cache directory: what every other module builds on.

Kept apart from the manifest and the checkpoint so that both can hash files without importing each
other. Digests of large files are cached keyed by the file's (size, mtime, ctime, inode): any write to
the file changes its ctime, which no tool can set back, so a cached digest is never stale.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Dict

log = logging.getLogger(__name__)

_CHUNK = 1 << 22


def cache_dir() -> Path:
    """Where laya-aot keeps per-machine state (digests, probe verdicts): $LAYA_AOT_CACHE_DIR or ~/.cache."""
    root = os.environ.get("LAYA_AOT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "laya-aot")
    return Path(root)


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def sha256_tree(root: str | os.PathLike, file_digest: Callable[[Path], str] = sha256_file) -> str:
    """One digest for a directory: relative paths and file digests, sorted (a renamed file changes it)."""
    root = Path(root)
    h = hashlib.sha256()
    for p in sorted(x for x in root.rglob("*") if x.is_file()):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + file_digest(p).encode() + b"\n")
    return h.hexdigest()


def write_json_atomic(path: str | os.PathLike, data: Dict[str, Any]) -> None:
    """Write JSON through a temporary file and rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name("." + path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _stat_key(path: Path) -> str:
    st = path.stat()
    return "%s:%d:%d:%d:%d" % (path.resolve(), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def cached_sha256(path: Path) -> str:
    """sha256 of a file, reusing an earlier digest when the file provably did not change."""
    key = hashlib.sha256(_stat_key(path).encode()).hexdigest()
    store = cache_dir() / "digests" / (key + ".json")
    try:
        with open(store, encoding="utf-8") as f:
            return json.load(f)["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    digest = sha256_file(path)
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(store, {"path": str(path.resolve()), "sha256": digest})
    except OSError as e:  # a read-only home must not stop a load
        log.debug("could not cache digest of %s: %s", path, e)
    return digest

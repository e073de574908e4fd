"""Hashing, atomic writes and the per-machine cache directory: what every other module builds on.

Kept apart from the manifest and the checkpoint so that both can hash files without importing each
other. Digests of large files are cached keyed by the file's (size, mtime, ctime, inode): any write to
the file changes its ctime, which no tool can set back, so a cached digest is never stale.

A cache entry is a hint, never an authority: every module reads its entries through `read_cache_bytes` or
`read_cache_json`, which answer None (a miss: the caller recomputes) for anything but a regular file of a bounded
size holding what the caller expects, typed strictly. A damaged, swapped or hand-made entry, a FIFO, a link (to
/dev/zero or anywhere) or a directory in its place can make a start slower, never wrong, hung or dead.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import stat
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

log = logging.getLogger(__name__)

_CHUNK = 1 << 22


ENV_CACHE_DIR = "LAYA_AOT_CACHE_DIR"


def cache_dir() -> Path:
    """Where laya-aot keeps per-machine state (digests, probe verdicts): $LAYA_AOT_CACHE_DIR or ~/.cache."""
    root = os.environ.get(ENV_CACHE_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "laya-aot")
    return Path(root)


# the most bytes a cache entry of laya-aot's may hold (a verdict, a digest, a start cost, a tokenizer snapshot's
# facts: all under a few KiB); a caller with larger entries passes its own bound
MAX_CACHE_ENTRY_BYTES = 1 << 20


def read_cache_bytes(path: str | os.PathLike, max_bytes: int = MAX_CACHE_ENTRY_BYTES) -> Optional[bytes]:
    """The bytes of a cache entry, or None (a miss) unless it is a regular file of at most `max_bytes`.

    The entry is opened without following a link and without blocking (a FIFO in its place opens at once and
    is refused by its type), and never more than `max_bytes` + 1 bytes are read (a file that grows meanwhile
    is refused too): whatever is at `path`, this returns within a read of `max_bytes`."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as e:  # a link (ELOOP), a directory opened oddly, no permission: a miss
        _not_used(path, "it cannot be opened as a file (%s)" % (e.strerror or e))
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            _not_used(path, "it is not a regular file")
            return None
        if st.st_size > max_bytes:
            _not_used(path, "it is %d bytes, more than such an entry ever is (%d)" % (st.st_size, max_bytes))
            return None
        chunks, left = [], max_bytes + 1
        while left > 0:
            block = os.read(fd, min(left, _CHUNK))
            if not block:
                break
            chunks.append(block)
            left -= len(block)
        data = b"".join(chunks)
        if len(data) > max_bytes:
            _not_used(path, "it grew past %d bytes while it was read" % max_bytes)
            return None
        return data
    except OSError as e:
        _not_used(path, "it cannot be read (%s)" % (e.strerror or e))
        return None
    finally:
        os.close(fd)


# what `read_cache_json` checks a field against: a type, a tuple of types (bool is never an int or a float unless
# named), or a predicate
FieldCheck = Union[type, Tuple[type, ...], Callable[[Any], bool]]


def finite_number(value: Any) -> bool:
    """A field check: an int or a float (not a bool), finite."""
    return type(value) in (int, float) and math.isfinite(value)


def sha256_hex(value: Any) -> bool:
    """A field check: a sha256 as 64 lowercase hex digits."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _fits(value: Any, check: FieldCheck) -> bool:
    if isinstance(check, (type, tuple)):
        types = check if isinstance(check, tuple) else (check,)
        if isinstance(value, bool) and bool not in types:
            return False
        return isinstance(value, types)
    try:
        return bool(check(value))
    except Exception:  # noqa: BLE001 - a predicate that cannot judge a value refuses it
        return False


def _no_constant(name: str) -> Any:
    raise ValueError("%s is not JSON a cache entry holds" % name)


def read_cache_json(path: str | os.PathLike, fields: Mapping[str, FieldCheck],
                    max_bytes: int = MAX_CACHE_ENTRY_BYTES) -> Optional[Dict[str, Any]]:
    """A cache entry's JSON object when it is one (`read_cache_bytes`) and each of `fields` is present with a value
    that passes its check, else None (a miss). Valid JSON of another shape, NaN or Infinity, nesting too deep to
    parse: a miss, never a TypeError or a RecursionError in the caller."""
    data = read_cache_bytes(path, max_bytes)
    return None if data is None else parse_cache_json(data, fields, path)


def parse_cache_json(data: bytes, fields: Mapping[str, FieldCheck], source: str | os.PathLike
                     ) -> Optional[Dict[str, Any]]:
    """`read_cache_json` for bytes already read (`source` names them in the log): what a cache entry would hold."""
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        _not_used(source, "it is not JSON (%s)" % str(e)[:80])
        return None
    if not isinstance(value, dict):
        _not_used(source, "it holds a JSON %s, not an object" % type(value).__name__)
        return None
    for name, check in fields.items():
        if name not in value or not _fits(value[name], check):
            _not_used(source, "its %r is %s" % (name, "missing" if name not in value else
                                               "%s %.40r" % (type(value[name]).__name__, value[name])))
            return None
    return value


def _not_used(path: str | os.PathLike, why: str) -> None:
    log.info("laya-aot: cache entry %s not used: %s; recomputed", path, why)


def sha256_file(path: str | os.PathLike, expect: Optional[str] = None) -> str:
    """A file's sha256, read now (`expect`, which `cached_sha256` takes, changes nothing here)."""
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


def write_bytes_atomic(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> None:
    """Write bytes through a temporary file of a unique name and rename it into place.

    Readers never see half a file, and writers racing on one path (several processes caching the same
    probe verdict) never trip over each other's temporary file: the last rename wins, whole. The file
    gets `mode` (default 0644), not mkstemp's 0600, so another user (a service account) can read it.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix="." + path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, data: Dict[str, Any]) -> None:
    """Write JSON atomically (`write_bytes_atomic`): readers see the old file or the new one, never a mix."""
    write_bytes_atomic(path, (json.dumps(data, indent=2, sort_keys=False) + "\n").encode("utf-8"))


# what stops a cache entry being written (the entry's path, a file on its way, or the cache directory) and the work
# that costs, each pair warned about once per process (`cache_unwritable`)
_UNWRITABLE: set = set()
_UNWRITABLE_GUARD = threading.Lock()


def write_cache_entry(path: str | os.PathLike, data: bytes, redo: str = "every start does its work again") -> bool:
    """Store a cache entry (its directories made, written atomically: `write_bytes_atomic`); False where it cannot
    be. The cache only saves work, so the caller goes on without it; `cache_unwritable` says why, once."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, data)
        return True
    except OSError as e:
        cache_unwritable(path, e, redo)
        return False


def write_cache_json(path: str | os.PathLike, data: Dict[str, Any],
                     redo: str = "every start does its work again") -> bool:
    """`write_cache_entry` of a JSON object."""
    return write_cache_entry(path, (json.dumps(data, indent=2, sort_keys=False) + "\n").encode("utf-8"), redo)


def cache_unwritable(path: str | os.PathLike, e: OSError, redo: str = "every start does its work again") -> None:
    """Warn that cache entry `path` cannot be written (`e`), naming the cause and the fix: an entry that can never be
    replaced costs its work (`redo`) on every start, which nothing above INFO said. Once per process for what stops
    it (the entry, a file in a directory's place, the cache directory) and `redo`, so a read-only cache is one
    warning per sort of work, not one per entry."""
    blocker, cause, fix = _what_blocks(Path(path), e)
    with _UNWRITABLE_GUARD:
        if (blocker, redo) in _UNWRITABLE:
            log.debug("cache entry %s not written: %s", path, cause)
            return
        _UNWRITABLE.add((blocker, redo))
    log.warning("laya-aot: cannot write the cache entry %s: %s, so %s; %s, or set %s to a writable directory",
                path, cause, redo, fix, ENV_CACHE_DIR)


def _what_blocks(path: Path, e: OSError) -> Tuple[str, str, str]:
    """What stops `path` being written, why and what to do (`cache_unwritable`)."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            return str(path), "a directory is in its place", "remove it (rm -r %s)" % path
    except OSError:
        pass
    for parent in reversed(path.parents):  # from the top: the first thing on the way that is not a directory
        try:
            if not stat.S_ISDIR(os.stat(parent).st_mode):
                return str(parent), "%s is a file, not a directory" % parent, "remove %s" % parent
        except OSError:
            break
    root = cache_dir()
    where = ": %s" % e.filename if e.filename and e.strerror else ""
    return str(root), "the cache at %s is not writable (%s%s)" % (root, e.strerror or e, where), \
        "make it writable for this user"


def make_readable(root: str | os.PathLike) -> None:
    """Give a tree written by this process normal permissions: directories 0755, files 0644 (0755 when
    executable). Some writers (mkstemp, mkdtemp, safetensors) leave 0600/0700, and a bundle built by one
    user must load for another (a service account)."""
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                continue
            os.chmod(p, 0o755 if os.stat(p).st_mode & 0o111 else 0o644)


def _stat_key(path: Path) -> str:
    st = path.stat()
    return "%s:%d:%d:%d:%d" % (path.resolve(), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


_DIGEST_ENTRY_BYTES = 64 << 10  # a digest entry: a path and a sha256
_DIGESTING: Dict[str, threading.Lock] = {}  # one lock per file and digest being computed (`_cached`)
_DIGESTING_GUARD = threading.Lock()
# digests of files inside the cache, hashed by this process (an unpack's check and the artifact's check of one
# start read each file once)
_HASHED_HERE: Dict[Tuple[str, str], str] = {}
# the piece of a file each thread of `sha256_parts` hashes (what a build records; a check uses the recorded size)
PART_BYTES = 32 << 20


def sha256_parts(path: str | os.PathLike, part_bytes: int = PART_BYTES, workers: Optional[int] = None) -> str:
    """A digest of a file that several threads compute at once: sha256 over the file's size, `part_bytes` and
    the sha256 of each `part_bytes` piece in order. It binds the file's bytes as its sha256 does (any other
    file changes some piece's digest, hence this one), and with cores to spare it is faster in proportion to
    its threads (hashlib lets go of the GIL): what a first start checks a large checkpoint with."""
    size = os.path.getsize(path)
    count = max(1, -(-size // part_bytes))
    workers = max(1, min(workers or _spare_cores(), count))
    fd = os.open(path, os.O_RDONLY)

    def part(i: int) -> bytes:
        h, at, end = hashlib.sha256(), i * part_bytes, min(size, (i + 1) * part_bytes)
        while at < end:
            block = os.pread(fd, min(_CHUNK, end - at), at)
            if not block:
                raise OSError("%s became shorter while it was read" % path)
            h.update(block)
            at += len(block)
        return h.digest()

    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="laya-aot-digest") as pool:
            digests = list(pool.map(part, range(count)))
    finally:
        os.close(fd)
    h = hashlib.sha256(b"laya-aot sha256-parts\0%d\0%d\0" % (size, part_bytes))
    for d in digests:
        h.update(d)
    return h.hexdigest()


def _spare_cores(keep: int = 2, most: int = 8) -> int:
    """Threads `sha256_parts` hashes with by default: this process's cores less `keep` for the start's other
    work beside it (laya's agent, the artifact's load), at most `most`: on a 2-core machine a second hashing
    thread slowed that work as much as it saved (`benchmarks/results/cpu.md`)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(most, cores - keep))


def cached_sha256(path: Path, expect: Optional[str] = None) -> str:
    """sha256 of a file, reusing an earlier digest when the file provably did not change. Threads asking for
    the same file take turns: the second reads the digest the first stored (a start's head start and its
    loader both check the checkpoint's fingerprint; a large one takes a second to hash).

    A digest entry saves a hash; it never refuses a file nor vouches for one anybody could change: a cached digest
    other than `expect` (the one the caller compares with) is computed again and the entry rewritten (an entry
    damaged or edited refused an intact file on every start), and a file inside laya-aot's own cache (an unpacked
    pack) is always hashed (whoever can write it can write its entry too)."""
    return _cached(path, "sha256", sha256_file, expect)


def cached_sha256_parts(path: Path, part_bytes: int = PART_BYTES, expect: Optional[str] = None) -> str:
    """`sha256_parts` of a file, cached and shared between threads as `cached_sha256` is."""
    return _cached(path, "sha256-parts-%d" % part_bytes, lambda p: sha256_parts(p, part_bytes), expect)


# directories whose files are hashed as the cache's are (`hash_always`)
_HASH_ALWAYS: List[Path] = []


def hash_always(root: str | os.PathLike) -> None:
    """Hash the files under `root` on every check, as the cache's are (`cached_sha256`): a directory of this
    process's own holding what would have been in the cache (`staging.private_dir`), which a digest entry must
    not vouch for either."""
    _HASH_ALWAYS.append(Path(root).resolve())


def _in_cache(path: Path) -> bool:
    try:
        where = path.resolve()
        return where.is_relative_to(cache_dir().resolve()) or any(where.is_relative_to(d) for d in _HASH_ALWAYS)
    except OSError:
        return False


def _cached(path: Path, name: str, digest_of: Callable[[Path], str], expect: Optional[str] = None) -> str:
    if _in_cache(path):  # kept in this process only: a write changes the ctime, hence the key
        seen = (_stat_key(path), name)
        digest = _HASHED_HERE.get(seen)
        if digest is None:
            digest = _HASHED_HERE[seen] = digest_of(path)
        return digest
    key = hashlib.sha256(_stat_key(path).encode()).hexdigest()
    with _DIGESTING_GUARD:
        lock = _DIGESTING.setdefault(key + name, threading.Lock())
    with lock:
        store = cache_dir() / "digests" / (key + (".json" if name == "sha256" else ".%s.json" % name))
        where = str(path.resolve())
        cached = read_cache_json(store, {name: sha256_hex, "path": str}, _DIGEST_ENTRY_BYTES)
        # the path: an entry copied from another file's is not this one's; `expect`: a differing one is checked
        if cached is not None and cached["path"] == where and (expect is None or cached[name] == expect):
            return cached[name]
        digest = digest_of(path)
        write_cache_json(store, {"path": where, name: digest}, "every start hashes the files it checks again")
        return digest

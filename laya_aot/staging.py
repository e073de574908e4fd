"""Assemble an output beside its destination and swap it into place in one step; whether it may be; and what
of a killed command's leftovers is laya-aot's to remove.

Shared by everything that writes a bundle (`laya-aot build`, `merge`, `unpack`, `fetch`) through `staged`, by
`make-demo` for its checkpoint directory (`demo.make_checkpoint`, also a build's demo checkpoint), and by `pack`
for its file (`staged_file`). `may_replace` is the one place that decides whether an output path may be replaced:
what is there must be absent, an empty directory, or something this project wrote, proven by its contents (a
bundle: `complete_bundle`); anything else needs the command's `--overwrite` (`overwrite=true` for a build), and a
file is never replaced by a directory's command nor a directory by a file's.

A command writes into `.<name>.partial-<token>` next to its output and, once complete, exchanges it with the
output atomically (Linux `renameat2(RENAME_EXCHANGE)`; elsewhere two renames, through `.<name>.old-<token>`).
Each of those directories holds a marker (`MARKER`: the owner's uid, pid and process start, and the token its
name ends with) from the moment it is made until it is gone. A command killed at any point leaves either the
previous output or nothing at the output path, never a directory that looks complete; the next command writing
that output removes the leftovers whose marker is valid and whose owner is gone, and nothing else: a directory
named like a leftover without a valid marker, another user's, or a running command's stays (`stale_reason`).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import errno
import json
import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional

from .bundle_format import check_files, files_of, manifest_files, read_manifest
from .files import cached_sha256, hash_always
from .manifest import MANIFEST, Bundle, BundleError, FileRecord

log = logging.getLogger(__name__)

# the marker inside a staging or backup directory: JSON written by `_mark`, read back by `stale_reason`
MARKER = ".laya-aot-staging.json"
_MARKER_MAX_BYTES = 4096
_WRITTEN_BY = "laya-aot staging"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_TOKEN_BYTES = 8  # 16 hex digits in the name: unique beside one output, short enough for long output names
_LEFTOVER = re.compile(r"\.(partial|old)-([0-9a-f]{%d})" % (2 * _TOKEN_BYTES))
# The file a `pack` of an older laya-aot wrote (`.FILE.partial-PID`). Never removed: a user's copy of a pack under
# that name cannot be told from a killed pack's leftover by its content, so it is only named.
_OLDER_PACK = re.compile(r"\.partial-[0-9]+")
_OLDER_PACK_REASON = ("it is a file named as an older laya-aot's `pack` named the file it was writing, and a user's "
                      "copy of a pack may be named so too")


def start_ticks(pid: int) -> Optional[int]:
    """When process `pid` started (clock ticks since boot, Linux), which tells a pid reused by another process
    from the one that wrote a marker; None where /proc cannot say."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            text = f.read()
        return int(text[text.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_alive(pid: int, started: Optional[int] = None) -> bool:
    """Whether process `pid` runs (and, when `started` is known, is the process that started then)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    now = start_ticks(pid) if started is not None else None
    return now is None or now == started


def _mark(directory: Path, token: str) -> None:
    """Write the marker that makes `directory` this process's to remove once it is gone."""
    record = {"written_by": _WRITTEN_BY, "uid": os.getuid(), "pid": os.getpid(),
              "started": start_ticks(os.getpid()), "token": token}
    fd = os.open(directory / MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(record, f)


def _read_marker(directory: Path) -> Optional[Dict[str, Any]]:
    """The marker of `directory` (a regular file of ours, bounded, a JSON object), else None."""
    try:
        fd = os.open(directory / MARKER, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > _MARKER_MAX_BYTES:
            return None
        try:
            data = json.loads(f.read(_MARKER_MAX_BYTES + 1).decode("utf-8"))
        except (OSError, ValueError):
            return None
    return data if isinstance(data, dict) else None


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def stale_reason(path: Path, out_name: str) -> Optional[str]:
    """Why `path`, named like a leftover of output `out_name` (`.NAME.partial-*`, `.NAME.old-*`), must stay
    (None: a killed command of this user left it, and removing it loses nothing of anyone's)."""
    beside = path.name.startswith(".%s." % out_name)
    kind = _LEFTOVER.fullmatch(path.name[len(out_name) + 1:]) if beside else None
    if kind is None:
        if beside and _OLDER_PACK.fullmatch(path.name[len(out_name) + 1:]) and _regular(path):
            return _OLDER_PACK_REASON
        return "its name is not one laya-aot gives (.%s.partial-<16 hex digits>)" % out_name
    try:
        st = os.lstat(path)
    except OSError as e:
        return "it cannot be read (%s)" % (e.strerror or e)
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.getuid():
        return "another user owns it"
    marker = _read_marker(path)
    if marker is None or marker.get("written_by") != _WRITTEN_BY:
        return "it holds no laya-aot marker (%s)" % MARKER
    pid, started = marker.get("pid"), marker.get("started")
    if marker.get("token") != kind.group(2) or marker.get("uid") != os.getuid() or not isinstance(pid, int) \
            or isinstance(pid, bool) or not 0 < pid < 1 << 31 or not (started is None or isinstance(started, int)):
        return "its marker is not the one laya-aot wrote for it"
    if process_alive(pid, started):
        return "process %d, which is writing it, is still running" % pid
    return None


def clean_stale(out: Path) -> None:
    """Remove what killed commands writing `out` left beside it (`stale_reason` decides what may go)."""
    try:
        names = [n for n in os.listdir(out.parent) if n.startswith(".%s." % out.name)
                 and n[len(out.name) + 2:].startswith(("partial-", "old-"))]
    except OSError:
        return
    for name in names:
        p = out.parent / name
        why = stale_reason(p, out.name)
        if why is None:
            log.info("removing %s, left by an interrupted laya-aot command", p)
            _remove(p)
        elif "still running" in why:
            log.debug("leaving %s: %s", p, why)
        else:
            log.warning("leaving %s in place: it is named like laya-aot's leftovers but %s; %s", p, why,
                        "if it is an interrupted pack's leftover, you may remove it" if why == _OLDER_PACK_REASON
                        else "remove it yourself if it is not needed")


def _remove(directory: Path) -> None:
    """Remove a marked directory, its marker last: a kill halfway leaves it marked for the next command."""
    try:
        entries = [e for e in os.scandir(directory) if e.name != MARKER]
    except OSError:
        return
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(e.path)
    with contextlib.suppress(OSError):
        os.unlink(directory / MARKER)
    with contextlib.suppress(OSError):
        os.rmdir(directory)


@contextlib.contextmanager
def writing(out: Path) -> Iterator[None]:
    """Hold `out` for this process while it writes it: an exclusive lock (`flock`) on `.NAME.lock` beside it, which
    the kernel releases when the process ends, however it ends. Another command writing `out` meanwhile is refused
    at once (`OutputBusy`, naming this process): two commands never both publish at one output, and the second
    never silently replaces the first's. The lock file goes when the lock is released."""
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / (".%s.lock" % out.name)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as e:
            if e.errno not in (errno.EISDIR, errno.ELOOP):
                raise
            raise OutputRefused(_refused_lock(path, "a directory" if e.errno == errno.EISDIR else "a symbolic link",
                                              out)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, _MARKER_MAX_BYTES, 0).decode("utf-8", "replace").strip()
            os.close(fd)
            raise OutputBusy("%s is being written by another laya-aot command (%s); wait for it to finish, or write "
                             "to another output" % (out, "process %s" % holder if holder.isdigit() else
                                                    "its lock is %s" % path)) from None
        except BaseException:
            os.close(fd)
            raise
        try:  # the previous holder may have removed the file between this open and the lock: lock the new one
            held = os.fstat(fd)
            current = os.stat(path, follow_symlinks=False)
            if (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino):
                foreign = _not_a_lock(fd, held)
                if foreign is None:
                    break
                os.close(fd)
                raise OutputRefused(_refused_lock(path, foreign, out))
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # while still held: a waiting opener then finds another file and tries again
        os.close(fd)


def _refused_lock(path: Path, what: str, out: Path) -> str:
    return ("%s is %s, and laya-aot locks %s with a file of that name, which it empties and removes: nothing was "
            "touched; rename or remove it, or write to another output" % (path, what, out))


def _not_a_lock(fd: int, st: os.stat_result) -> Optional[str]:
    """What the file at a lock's name is, where it cannot be a lock `writing` made (None: it can: new and empty, or a
    killed command's, holding its process id): a user's file, a hard link to one (emptying it would empty the
    other name's file), anything but a regular file."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_nlink != 1:
        return "a file with %d names (hard links)" % st.st_nlink
    if st.st_size > 20 or not (os.pread(fd, 20, 0).strip() or b"0").isdigit():
        return "a file that is not a laya-aot lock (it holds more than a process id)"
    return None


def new_staging(out: Path) -> Path:
    """A new marked `.NAME.partial-<token>` directory beside `out` (0755), after removing killed ones' leftovers."""
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out)
    while True:
        token = secrets.token_hex(_TOKEN_BYTES)
        tmp = out.parent / (".%s.partial-%s" % (out.name, token))
        try:
            os.mkdir(tmp, 0o700)
        except FileExistsError:
            continue
        break
    try:
        _mark(tmp, token)
        os.chmod(tmp, 0o755)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def private_dir(prefix: str = "laya-aot-") -> Path:
    """A new directory of this process's own (`tempfile.mkdtemp`, 0700), removed when the process exits: where a
    load unpacks a pack the cache cannot take (`distribution.fetch`). Its files are hashed on every check, as the
    cache's are (`files.hash_always`)."""
    root = Path(tempfile.mkdtemp(prefix=prefix)).resolve()
    atexit.register(_remove_private, root, os.getpid())
    hash_always(root)
    return root


def _remove_private(root: Path, owner: int) -> None:
    if os.getpid() == owner:  # a forked child's exit leaves its parent's directory alone
        shutil.rmtree(root, ignore_errors=True)


Same = Callable[[Path], bool]  # whether what is at a path is already this result (a concurrent writer's)


@contextlib.contextmanager
def staged(out: Path, unwritable: Optional[Callable[[OSError], BaseException]] = None,
           same: Optional[Same] = None) -> Iterator[Path]:
    """The one staging transaction: a new `.NAME.partial-*` directory beside `out` to write into, published at
    `out` when the block ends and discarded when it raises (anything, KeyboardInterrupt included) or when
    publishing fails. `unwritable` turns an OSError making the directory into the caller's own error.

    `same`, for a deterministic result that concurrent writers make alike (a multirun's jobs making one demo
    checkpoint): when `same(out)` holds at publishing, another writer published this result first; it stays,
    and this staging is discarded, so whoever already reads or fingerprinted the first never sees it swapped.
    Without `same`, the transaction holds `out` (`writing`): another command writing it meanwhile is refused."""
    with contextlib.ExitStack() as held:
        try:
            if same is None:
                held.enter_context(writing(out))
            tmp = new_staging(out)
        except OSError as e:
            if unwritable is None:
                raise
            raise unwritable(e) from None
        try:
            yield tmp
            publish(tmp, out, same)
        except BaseException:
            discard(tmp)
            raise


@contextlib.contextmanager
def staged_file(out: Path) -> Iterator[Path]:
    """`staged` for a command that writes one file (`pack`): the path to write, inside a marked staging directory
    beside `out`, renamed onto `out` when the block ends; the directory goes either way, and a killed command's
    is removed by the next one writing `out`. It holds `out` as `staged` does (`writing`)."""
    with writing(out):
        tmp = new_staging(out)
        try:
            path = tmp / out.name
            yield path
            os.replace(path, out)
        finally:
            discard(tmp)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False when the platform cannot."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE)
    return rc == 0


def _mark_replaced(directory: Path, token: str) -> None:
    """Mark what was at the output, now beside it under a staging name, before it is removed: a kill while it is
    removed leaves it to the next command (a file is removed at once)."""
    if directory.is_dir() and not directory.is_symlink():
        with contextlib.suppress(OSError):
            _mark(directory, token)


def publish(staging: Path, out: Path, same: Optional[Same] = None) -> None:
    """Put the finished staging directory at `out`, replacing any previous output only now (unless `same(out)`:
    see `staged`)."""
    token = staging.name.rsplit("-", 1)[-1]
    (staging / MARKER).unlink(missing_ok=True)
    if same is not None and same(out):
        discard(staging)
        return
    if os.path.lexists(out) and _exchange(staging, out):
        _mark_replaced(staging, token)  # now holds what was at `out` (a previous bundle, or what --overwrite replaces)
        discard(staging)
        return
    if os.path.lexists(out):
        old = out.with_name(".%s.old-%s" % (out.name, token))
        os.replace(out, old)
        _mark_replaced(old, token)
        try:
            os.replace(staging, out)
        except OSError:
            os.replace(old, out)  # put it back, unmarked: it was never laya-aot's to remove
            (out / MARKER).unlink(missing_ok=True)
            raise
        discard(old)
        return
    try:
        os.replace(staging, out)
    except OSError:
        # another writer of the same output published a moment ago: keep it when it is this result, else
        # replace it, as a later build would
        if same is not None and same(out):
            discard(staging)
            return
        if not (out.exists() and _exchange(staging, out)):
            raise
        _mark_replaced(staging, token)
        discard(staging)


def discard(staging: Path) -> None:
    """Remove a staging directory (its marker last), or the file an exchange left at its name."""
    if staging.is_dir() and not staging.is_symlink():
        _remove(staging)
    else:  # after an exchange with a file that --overwrite replaced
        with contextlib.suppress(OSError):
            staging.unlink()


class OutputRefused(BundleError):
    """An output path holds something this project did not write (or cannot be read); nothing was touched."""


class OutputBusy(OutputRefused):
    """Another running command is writing the output (`writing`); nothing was touched."""


class OutputUnwritable(BundleError):
    """The output's directory cannot be made or written (`cause`, what `staged` met); nothing was written. A load
    whose cache is so goes on in a directory of its own (`distribution.fetch`)."""

    def __init__(self, message: str, cause: OSError):
        super().__init__(message)
        self.cause = cause


Proof = Callable[[Path], Optional[str]]  # why a path is not something this project wrote (None: it is)


def complete_bundle(out: Path) -> Optional[str]:
    """Why directory `out` is not a bundle this project wrote (None: it is, and replacing it loses nothing).

    Proof by contents: a manifest the strict reader accepts (whatever kinds it names: which kinds this laya-aot
    knows says nothing of who wrote it), and every entry under `out` bundle.json or a regular file the manifest
    lists at its size and sha256 (schema 1: inside an artifact's path, whose files add up to its sha256), or a
    directory on the way to one; no link. Listed files may be absent (a fetched bundle holds only the artifacts
    usable where it was fetched): what is present is only what the manifest pins."""
    try:
        data = read_manifest(out)
        arts = data.get("artifacts")
        named = {a["kind"] for a in arts if isinstance(a, dict) and isinstance(a.get("kind"), str)} \
            if isinstance(arts, list) else set()
        bundle = Bundle.from_dict(data, named, str(out / MANIFEST))
    except BundleError as e:
        return str(e).split(";")[0]
    listed: Dict[str, FileRecord] = {}
    if bundle.schema_version >= 2:
        listed = manifest_files(bundle)
    else:
        for a in bundle.artifacts:
            if a.built and os.path.lexists(out / str(a.path)):
                files, why = files_of(out, a)
                if why:
                    return why
                listed.update(files)

    def unreadable(e: OSError) -> None:  # a directory not listed could hold anything: not proven ours
        raise e

    present: Dict[str, FileRecord] = {}
    for dirpath, dirnames, filenames in os.walk(out, onerror=unreadable):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(out).as_posix()
            if stat.S_ISLNK(os.lstat(p).st_mode):
                return "it holds a symbolic link, %s" % rel
            if name in dirnames or rel == MANIFEST:
                continue
            if rel not in listed:
                return "it holds %s, which its manifest does not list" % rel
            present[rel] = listed[rel]
    why = check_files(out, present, cached_sha256, limit=1)
    return None if why is None else "%s (changed since it was written)" % why


def may_replace(out: str | os.PathLike, command: str, overwrite: bool = False, ours: Proof = complete_bundle,
                fix: str = "--overwrite", directory: bool = True, noun: str = "bundle", cache: bool = False) -> None:
    """Raise OutputRefused unless `command` may replace `out`: absent, an empty directory, or proven its own
    work by `ours`; with `overwrite` anything of the right sort (a directory for a directory's command, a
    file for a file's), and so with `cache`, where `out` is an entry of laya-aot's cache that laya-aot makes
    again (the log then says so: no user asked for --overwrite). Every command that writes an output asks this,
    and nothing else decides it. An OSError (a directory it may not read) propagates: the caller words it as a
    path it cannot write."""
    out = Path(out)
    what = "directory" if directory else "file"
    try:
        st = os.lstat(out)  # another OSError (a parent it may not enter) is the caller's to word: it cannot write
    except (FileNotFoundError, NotADirectoryError):
        return  # nothing there (below a file: writing it fails, and the caller says so)
    is_link, is_dir = stat.S_ISLNK(st.st_mode), stat.S_ISDIR(st.st_mode)
    if not directory:
        if is_dir:
            raise OutputRefused("%s is a directory; %s writes a file: name the file to write (for example "
                                "%s/bundle.tar.zst)" % (out, command, out))
        why = "it is a symbolic link" if is_link else ours(out)
        if why is None:
            return
    else:
        try:
            if is_dir and not any(out.iterdir()):
                return
            why = ("it is a symbolic link" if is_link else "it is not a directory" if not is_dir else ours(out))
        except OSError as e:
            raise OutputRefused("cannot read %s (%s); choose another output directory or fix its permissions"
                                % (out, e.strerror or e)) from None
        if why is None:
            return
    if cache:
        log.warning("%s: replacing the cache entry %s (%s) with a fresh copy", command, out, why)
        return
    if overwrite:
        log.warning("%s: replacing %s (%s), as %s asks", command, out, why, fix)
        return
    raise OutputRefused("%s exists and is not a laya-aot %s (%s); %s replaces the whole %s: choose another one, "
                        "or pass %s to replace it" % (out, noun, why, command, what, fix))

"""Assemble a bundle beside its destination and swap it into place in one step; and whether it may be.

Shared by everything that writes a bundle (`laya-aot build`, `merge`, `unpack`, `fetch`) through `staged`, and by
`make-demo` for its checkpoint directory (`demo.make_checkpoint`, also a build's demo checkpoint).
`may_replace` is the one place that decides whether an output path may be replaced (for `make-demo` and `pack` too):
what is there must be absent, an empty directory, or something this project wrote, proven by its
contents (a bundle: a manifest whose file list covers every file in the directory, nothing else, no
link); anything else needs the command's `--overwrite` (`overwrite=true` for a build), and a file is
never replaced by a directory's command nor a directory by a file's. A build writes into
`.<name>.partial-XXXX` next to the output directory and, once the manifest is written, exchanges it
with the output atomically (Linux `renameat2(RENAME_EXCHANGE)`; elsewhere two renames). A build
killed at any point leaves either the previous bundle or nothing at the output path, never a
directory that looks complete; the next build removes partial directories whose builder process is gone.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator, Optional

from .bundle_format import read_manifest
from .manifest import BundleError

log = logging.getLogger(__name__)

OWNER = ".builder-pid"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def new_staging(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out)
    tmp = Path(tempfile.mkdtemp(prefix=".%s.partial-" % out.name, dir=out.parent))
    os.chmod(tmp, 0o755)
    (tmp / OWNER).write_text(str(os.getpid()))
    return tmp


Same = Callable[[Path], bool]  # whether what is at a path is already this result (a concurrent writer's)


@contextlib.contextmanager
def staged(out: Path, unwritable: Optional[Callable[[OSError], BaseException]] = None,
           same: Optional[Same] = None) -> Iterator[Path]:
    """The one staging transaction: a new `.NAME.partial-*` directory beside `out` to write into, published at
    `out` when the block ends and discarded when it raises (anything, KeyboardInterrupt included) or when
    publishing fails. `unwritable` turns an OSError making the directory into the caller's own error.

    `same`, for a deterministic result that concurrent writers make alike (a multirun's jobs making one demo
    checkpoint): when `same(out)` holds at publishing, another writer published this result first; it stays,
    and this staging is discarded, so whoever already reads or fingerprinted the first never sees it swapped."""
    try:
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(out: Path) -> None:
    """Remove partial directories of `out` left by builds that were killed."""
    for p in out.parent.glob(".%s.partial-*" % out.name):
        try:
            pid = int((p / OWNER).read_text())
        except (OSError, ValueError):
            pid = -1
        if pid <= 0 or not _alive(pid):
            log.info("removing %s, left by an interrupted build or make-demo", p)
            shutil.rmtree(p, ignore_errors=True)
    for p in out.parent.glob(".%s.old-*" % out.name):
        shutil.rmtree(p, ignore_errors=True)


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


def publish(staging: Path, out: Path, same: Optional[Same] = None) -> None:
    """Put the finished staging directory at `out`, replacing any previous bundle only now (unless `same(out)`:
    see `staged`)."""
    (staging / OWNER).unlink(missing_ok=True)
    if same is not None and same(out):
        discard(staging)
        return
    if os.path.lexists(out) and _exchange(staging, out):
        discard(staging)  # now holds what was at `out` (a previous bundle, or what --overwrite replaces)
        return
    if os.path.lexists(out):
        old = out.with_name(".%s.old-%d" % (out.name, os.getpid()))
        os.replace(out, old)
        os.replace(staging, out)
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
        discard(staging)


def discard(staging: Path) -> None:
    if staging.is_dir() and not staging.is_symlink():
        shutil.rmtree(staging, ignore_errors=True)
    else:  # after an exchange with a file that --overwrite replaced
        try:
            staging.unlink()
        except OSError:
            pass


class OutputRefused(BundleError):
    """An output path holds something this project did not write (or cannot be read); nothing was touched."""


Proof = Callable[[Path], Optional[str]]  # why a path is not something this project wrote (None: it is)


def complete_bundle(out: Path) -> Optional[str]:
    """Why directory `out` is not a bundle this project wrote (None: it is, and replacing it loses nothing).

    Proof by contents, not by a marker: a manifest of ours, and every entry under `out` a regular file
    the manifest lists (at its listed size; schema 1: under an artifact's path), or a directory on the way
    to one. Listed files may be absent (a fetched bundle holds only the artifacts usable where it was
    fetched)."""
    try:
        raw = read_manifest(out)
    except BundleError as e:
        return str(e).split(";")[0]
    sizes = {"bundle.json": None}
    roots = []
    for a in raw.get("artifacts") or []:
        if not isinstance(a, dict):
            return "its manifest is damaged"
        files = a.get("files")
        if isinstance(files, dict):
            for rel, rec in files.items():
                sizes[str(rel)] = rec.get("size") if isinstance(rec, dict) else None
        if raw.get("schema_version") == 1 and isinstance(a.get("path"), str):
            roots.append(a["path"].strip("/"))

    def unreadable(e: OSError) -> None:  # a directory not listed could hold anything: not proven ours
        raise e

    for dirpath, dirnames, filenames in os.walk(out, onerror=unreadable):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(out).as_posix()
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                return "it holds a symbolic link, %s" % rel
            if name in dirnames:
                continue
            listed = rel in sizes or any(PurePosixPath(rel).is_relative_to(r) for r in roots if r)
            if not listed:
                return "it holds %s, which its manifest does not list" % rel
            if sizes.get(rel) is not None and st.st_size != sizes[rel]:
                return "%s is %d bytes, its manifest says %d (changed since it was written)" % (rel, st.st_size,
                                                                                              sizes[rel])
    return None


def may_replace(out: str | os.PathLike, command: str, overwrite: bool = False, ours: Proof = complete_bundle,
                fix: str = "--overwrite", directory: bool = True, noun: str = "bundle") -> None:
    """Raise OutputRefused unless `command` may replace `out`: absent, an empty directory, or proven its own
    work by `ours`; with `overwrite` anything of the right sort (a directory for a directory's command, a
    file for a file's). Every command that writes an output asks this, and nothing else decides it. An
    OSError (a directory it may not read) propagates: the caller words it as a path it cannot write."""
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
    if overwrite:
        log.warning("%s: replacing %s (%s), as %s asks", command, out, why, fix)
        return
    raise OutputRefused("%s exists and is not a laya-aot %s (%s); %s replaces the whole %s: choose another one, "
                        "or pass %s to replace it" % (out, noun, why, command, what, fix))

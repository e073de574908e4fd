"""Assemble a bundle beside its destination and swap it into place in one step.

Shared by everything that writes a bundle (`laya-aot build`, `merge`, `unpack`). A build writes into
`.<name>.partial-XXXX` next to the output directory and, once the manifest is written, exchanges it
with the output atomically (Linux `renameat2(RENAME_EXCHANGE)`; elsewhere two renames). A build
killed at any point leaves either the previous bundle or nothing at the output path, never a
directory that looks complete; the next build removes partial directories whose builder process is gone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

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
            log.info("removing %s, left by an interrupted build", p)
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


def publish(staging: Path, out: Path) -> None:
    """Put the finished staging directory at `out`, replacing any previous bundle only now."""
    (staging / OWNER).unlink(missing_ok=True)
    if out.exists() and _exchange(staging, out):
        shutil.rmtree(staging, ignore_errors=True)  # now holds the previous bundle
        return
    if out.exists():
        old = out.with_name(".%s.old-%d" % (out.name, os.getpid()))
        os.replace(out, old)
        os.replace(staging, out)
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        os.replace(staging, out)
    except OSError:
        # another build into the same output published a moment ago: replace it, as a later build would
        if not (out.exists() and _exchange(staging, out)):
            raise
        shutil.rmtree(staging, ignore_errors=True)


def discard(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)

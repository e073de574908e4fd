"""Compiler processes die with the build that started them, however the build ends.

A build spends most of its time in child processes (the C++ compiler AOTInductor runs, nvcc for
TileLang, Inductor's compile workers). Killed with SIGKILL (an operator, a CI timeout, the OOM killer),
the build cannot stop them, and they used to run on, orphaned. `ChildGuard` starts every child of the
build in its own process group and tells a small watchdog process each group's id through a pipe;
when the build dies the pipe closes, and the watchdog kills the groups (a compiler's own children,
such as cc1plus and as, are in its group). A build that ends normally tells the watchdog so, and the
groups are left alone (nothing of the build is running by then, except pools Inductor keeps on purpose).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from typing import Any, Optional

log = logging.getLogger(__name__)

# the watchdog: read process-group ids until "done" (the build finished) or EOF (the build died: kill them)
_WATCHDOG = r"""
import os, signal, sys
groups = set()
for line in sys.stdin.buffer:
    line = line.strip()
    if line == b"done":
        sys.exit(0)
    if line.isdigit():
        groups.add(int(line))
for g in groups:
    try:
        os.killpg(g, signal.SIGKILL)
    except OSError:
        pass
"""

_lock = threading.Lock()
_active: Optional["ChildGuard"] = None


class ChildGuard:
    """While open, every `subprocess.Popen` of this process starts its child in a new process group that
    the watchdog kills if this process dies. Close it (or use it as a context manager) when the build ends."""

    def __init__(self) -> None:
        global _active
        self._w: Optional[int] = None
        self._watchdog: Optional[subprocess.Popen] = None
        self._original: Any = None
        with _lock:
            # nested builds share the outer guard; Popen(process_group=) needs Python 3.11
            if _active is not None or os.name != "posix" or sys.version_info < (3, 11):
                return
            r, w = os.pipe()
            try:
                # its own session: a Ctrl-C at the terminal ends the build, which closes the pipe; the
                # watchdog itself must outlive the build to do its job
                self._watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG], stdin=r, close_fds=True,
                                                  start_new_session=True, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL)
            except OSError as e:
                os.close(w)
                log.debug("no watchdog for the build's child processes: %s", e)
                return
            finally:
                os.close(r)
            self._w = w
            self._original = subprocess.Popen
            subprocess.Popen = _grouped(self._original, self)  # type: ignore[misc]
            _active = self

    def register(self, pgid: int) -> None:
        if self._w is not None:
            try:
                os.write(self._w, b"%d\n" % pgid)
            except OSError as e:  # the watchdog is gone: the child simply runs unguarded
                log.debug("could not register child group %d: %s", pgid, e)

    def close(self) -> None:
        """The build ended normally (or raised): its children were waited for; stop the watchdog."""
        global _active
        with _lock:
            if self._w is None:
                return
            if _active is self:
                subprocess.Popen = self._original  # type: ignore[misc]
                _active = None
            try:
                os.write(self._w, b"done\n")
            except OSError:
                pass
            os.close(self._w)
            self._w = None
        if self._watchdog is not None:
            try:
                self._watchdog.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._watchdog.kill()

    def __enter__(self) -> "ChildGuard":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _grouped(base: Any, guard: ChildGuard) -> Any:
    class GroupedPopen(base):  # type: ignore[misc, valid-type]
        """`subprocess.Popen`, with the child in a new process group the build's watchdog knows."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            own = kwargs.get("start_new_session") or kwargs.get("process_group") is not None \
                or kwargs.get("preexec_fn") is not None
            if not own:
                kwargs["process_group"] = 0
            super().__init__(*args, **kwargs)
            if not own:
                guard.register(self.pid)

    GroupedPopen.__name__ = GroupedPopen.__qualname__ = "Popen"
    return GroupedPopen

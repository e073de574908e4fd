"""Live status lines for work that takes more than a few seconds: one owner for how progress looks and when.

A stage that runs for minutes without a word looks like a hang. Every long step (a build stage, the
artifacts and cases of a verification, training the demo model) opens a `task`: a line on stderr with a
spinner, its description, `done/total` when counted, and the elapsed time, rewritten in place while the
step runs and removed when it ends. Lines show only on a terminal; piped output and `--quiet`
(`set_quiet`, `LAYA_AOT_QUIET=1`) get none, so logs and CI output stay clean. All tasks share one rich
`Progress` (rich allows one live display at a time), so nested steps show as nested lines.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Iterator, Optional

_lock = threading.Lock()
_quiet = bool(os.environ.get("LAYA_AOT_QUIET"))
_progress: Any = None  # the shared rich Progress while a task is open
_open = 0


def set_quiet(quiet: bool = True) -> None:
    """No live lines from now on (the CLI's `--quiet`)."""
    global _quiet
    _quiet = quiet


def shown() -> bool:
    """Whether live lines show: stderr is a terminal and nobody asked for quiet."""
    return not _quiet and sys.stderr.isatty()


def console():
    """The stderr console live lines are drawn on; print through it to put a line above them."""
    from rich.console import Console

    if _progress is not None:
        return _progress.console
    return Console(stderr=True, width=None if sys.stderr.isatty() else 160)


class Task:
    """One live line; `advance` counts work done, `describe` changes what it says."""

    def __init__(self, progress: Any = None, task_id: Any = None) -> None:
        self._progress, self._id = progress, task_id

    def advance(self, n: int = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._id, n)

    def describe(self, description: str, total: Optional[int] = None, completed: Optional[int] = None) -> None:
        if self._progress is not None:
            self._progress.update(self._id, description=description, total=total, completed=completed)

    def close(self) -> None:
        """Remove the line (the last task closed ends the live display)."""
        global _progress, _open
        if self._progress is None:
            return
        with _lock:
            self._progress.remove_task(self._id)
            self._progress = None
            _open -= 1
            if _open == 0 and _progress is not None:
                _progress.stop()
                _progress = None


def _count_column() -> Any:
    """A rich column: "3/12" when the task is counted ("1.5/40.2 MB" when it counts bytes), nothing when it is
    not. Made on first use: rich's progress module costs a start 0.1 s to import, and a start shows no lines."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class Count(ProgressColumn):
        def render(self, task: Any) -> Text:
            if task.total is None:
                return Text("")
            if task.fields.get("unit") == "bytes":
                return Text("%.1f/%.1f MB" % (task.completed / 1e6, task.total / 1e6), style="progress.download")
            return Text("%d/%d" % (task.completed, task.total), style="progress.download")

    return Count()


def start(description: str, total: Optional[int] = None, unit: Optional[str] = None) -> Task:
    """Open a live line (a no-op Task when lines do not show); `close()` it when the step ends. `unit="bytes"`:
    `total` and `advance` count bytes."""
    global _progress, _open
    if not shown():
        return Task()
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with _lock:
        if _progress is None:
            _progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), _count_column(),
                                 TimeElapsedColumn(), console=console(), transient=True)
            _progress.start()
        _open += 1
        return Task(_progress, _progress.add_task(description, total=total, unit=unit))


@contextlib.contextmanager
def task(description: str, total: Optional[int] = None, unit: Optional[str] = None) -> Iterator[Task]:
    """A live line while the block runs: `with progress.task("verify", total=n) as t: ... t.advance()`."""
    t = start(description, total, unit)
    try:
        yield t
    finally:
        t.close()

"""Progress per stage while a build runs, and the summary table at its end (rich)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..manifest import Bundle

_STYLE = {"ok": "green", "skipped": "yellow", "failed": "red", "running": "cyan"}


class Reporter:
    """A spinner with elapsed time per stage (AOTInductor takes tens of seconds), then its outcome."""

    def __init__(self) -> None:
        self.console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                  console=self.console, transient=True)
        self._tasks: Dict[str, Any] = {}

    def __enter__(self) -> "Reporter":
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def update(self, rec: Dict[str, Any]) -> None:
        name, status = rec["name"], rec["status"]
        if status == "running":
            self._tasks[name] = self._progress.add_task("stage [bold]%s[/]" % name, total=None)
            return
        task = self._tasks.pop(name, None)
        if task is not None:
            self._progress.remove_task(task)
        detail = rec.get("summary") or rec.get("error") or ""
        self._progress.console.print("[%s]%-8s[/] %-15s %6.1f s  %s" % (
            _STYLE.get(status, "white"), status, name, rec.get("seconds", 0.0), detail))


def _fmt_size(n: Any) -> str:
    return "-" if not n else ("%.1f MB" % (n / 1e6) if n >= 1e5 else "%.1f kB" % (n / 1e3))


def summary_table(bundle: Bundle, output_dir: Path) -> Table:
    t = Table(title="bundle %s (checkpoint %s)" % (output_dir, bundle.checkpoint.name))
    for col in ("artifact", "variant", "dtype", "size", "status", "max |dp| option/action", "argmax", "ms @1x128x4"):
        t.add_column(col)
    for a in bundle.artifacts:
        v = a.verify
        lat = (next(iter(a.latency_ms.values()), {}) or {}).get("1x128x4")
        diff = ("%.2g / %.2g" % (v.max_abs_option_prob, v.max_abs_action_prob)
                if v and v.max_abs_option_prob is not None else ((v.reason if v else None) or a.error or "-"))
        t.add_row(a.name, str(a.variant), str(a.dtype or "-"), _fmt_size(a.size),
                  "[%s]%s[/]" % ("green" if a.status == "verified" else "red", a.status), diff[:90],
                  "%.1f%%" % (100 * v.argmax_agreement) if v and v.argmax_agreement is not None else "-",
                  "%.2f" % lat if lat is not None else "-")
    eager = (next(iter(bundle.eager_latency_ms.values()), {}) or {}).get("1x128x4")
    if eager is not None:
        t.caption = "eager fp32 reference: %.2f ms @1x128x4 on the build machine" % eager
    return t

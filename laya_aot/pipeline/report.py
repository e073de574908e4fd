"""Progress per stage while a build runs, and the summary table at its end (rich)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from rich.table import Table

from .. import progress
from ..manifest import Bundle

_STYLE = {"ok": "green", "skipped": "yellow", "failed": "red", "running": "cyan"}


class Reporter:
    """A live line with elapsed time per stage (AOTInductor takes tens of seconds), then its outcome line."""

    def __init__(self) -> None:
        self.console = progress.console()
        self._tasks: Dict[str, progress.Task] = {}

    def __enter__(self) -> "Reporter":
        return self

    def __exit__(self, *exc) -> None:
        for task in self._tasks.values():
            task.close()
        self._tasks.clear()

    def update(self, rec: Dict[str, Any]) -> None:
        name, status = rec["name"], rec["status"]
        if status == "running":
            self._tasks[name] = progress.start("stage [bold]%s[/]" % name)
            return
        task = self._tasks.pop(name, None)
        if task is not None:
            task.close()
        detail = rec.get("summary") or rec.get("error") or ""
        progress.console().print("[%s]%-8s[/] %-15s %6.1f s  %s" % (
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

"""A PNG of `gpu_profile.py`'s results: per realistic call, each path's forward and host time against the
dense 16-bit limit of the forward and issue 24's target for the call.

    python benchmarks/plot_calls.py benchmarks/results/gpu_h200_profile/profile_large-1024_run1.json OUT.png

Needs matplotlib (not a dependency of laya-aot: `pip install matplotlib` where the plot is made).
"""
from __future__ import annotations

import json
import sys

TARGETS_MS = {"1x1q_20w": 2.0, "8x3q_120w": 16.0, "32x3q_400w": 160.0}  # issue 24's per-call targets
TITLES = {"1x1q_20w": "1 state x 1 question, 20 words", "8x3q_120w": "8 states x 3 questions, 120 words",
          "32x3q_400w": "32 states x 3 questions, 400 words"}


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = json.loads(open(src, encoding="utf-8").read())
    paths = [p for p in r["paths"] if r["paths"][p].get("calls")]
    calls = list(TARGETS_MS)
    fig, axes = plt.subplots(1, len(calls), figsize=(4.2 * len(calls), 4.2))
    for ax, call in zip(axes, calls):
        fwd = [r["paths"][p]["calls"][call]["forward_ms"] for p in paths]
        host = [r["paths"][p]["calls"][call]["host_ms"] for p in paths]
        ax.bar(paths, fwd, color="#4c72b0", label="forward")
        ax.bar(paths, host, bottom=fwd, color="#dd8452", label="host (laya's tokenising, packing, ...)")
        for i, p in enumerate(paths):
            m = r["paths"][p]["calls"][call]
            label = ("%.2f ms" if m["total_ms"] < 10 else "%.1f ms") % m["total_ms"]
            ax.text(i, m["total_ms"], label, ha="center", va="bottom", fontsize=9)
        limit = max(r["paths"][p]["calls"][call]["limit_ms"] for p in paths)
        ax.axhline(limit, color="black", linestyle=":", label="dense bf16 limit of the forward")
        ax.axhline(TARGETS_MS[call], color="#c44e52", linestyle="--", label="issue 24's target")
        ax.set_title(TITLES[call], fontsize=10)
        ax.set_ylabel("ms per call")
    axes[0].legend(fontsize=8, loc="upper right")
    fig.suptitle("%s on %s: laya eager against the default bundle (median of 15)" % (r["shape"], "an H200"),
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

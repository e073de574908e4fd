"""A PNG of `gpu_profile.py`'s results: per realistic call, each path's forward and host time against the
dense 16-bit limit of the forward and the call's latency target.

    python benchmarks/plot_calls.py PROFILE.json [--png OUT.png]

PROFILE.json is what `gpu_profile.py` wrote (profile_<shape><tag>.json); the PNG goes to --png, by default
calls_<shape>.png in --out. Needs matplotlib (not a dependency of laya-aot: `pip install matplotlib`).
"""
from __future__ import annotations

import json
from pathlib import Path

import harness

TARGETS_MS = {"1x1q_20w": 2.0, "8x3q_120w": 16.0, "32x3q_400w": 160.0}  # the per-call latency targets
TITLES = {name: "%d state%s x %d question%s, %d words" % (n, "s" * (n > 1), len(q), "s" * (len(q) > 1), words)
          for name, n, words, q in harness.CALLS}


def plot(r: dict, dst: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        ax.axhline(TARGETS_MS[call], color="#c44e52", linestyle="--", label="latency target")
        ax.set_title(TITLES[call], fontsize=10)
        ax.set_ylabel("ms per call")
    axes[0].legend(fontsize=8, loc="upper right")
    gpus = (r.get("environment") or {}).get("gpus") or ["the GPU"]
    fig.suptitle("%s on %s: laya eager against the default bundle (median of 15)" % (r["shape"], gpus[0].split(",")[0]),
                 fontsize=11)
    fig.tight_layout()
    dst.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dst, dpi=110)


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("profile", type=Path, help="gpu_profile.py's profile_<shape><tag>.json")
    ap.add_argument("--png", type=Path, help="where the plot goes (default: calls_<shape><tag>.png in --out)")
    a = ap.parse_args()
    r = json.loads(a.profile.read_text(encoding="utf-8"))
    plot(r, a.png or a.out / ("calls_%s%s.png" % (r["shape"], a.tag)))


if __name__ == "__main__":
    main()

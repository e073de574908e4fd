"""A PNG of `peer.py`'s calls: per checkpoint, each call's median time for laya eager, laya-aot and laya-cuda's
faster mode, on a log scale, with laya-aot's ratio to laya-cuda over its bar.

    python benchmarks/plot_peer.py PEER.json [PEER.json ...] [--png docs/img/peer_calls.png]

Each PEER.json is what `peer.py` wrote (peer<tag>.json); every checkpoint in them gets a panel. Needs matplotlib
(not a dependency of laya-aot: `pip install matplotlib`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import harness

PATHS = (("eager", "laya eager"), ("aot", "laya-aot"), ("cuda", "laya-cuda"))
COLORS = {"eager": "#b0b0b0", "aot": "#1f6fb4", "cuda": "#e07b2a"}


def rows(modes: Dict[str, dict]) -> List[Tuple[str, Dict[str, Optional[float]]]]:
    """(call, {path: ms}) for every call laya-aot answered; laya-cuda's is its faster mode on that call."""
    def ms(mode: str, call: str) -> Optional[float]:
        r = modes.get(mode) or {}
        if call.startswith("stream "):
            return (r.get("stream") or {}).get("%s_ms" % call.split()[1])
        return (r.get("calls_ms") or {}).get(call)

    calls = list((modes.get("aot") or {}).get("calls_ms") or {}) + ["stream p50", "stream p95"]
    out = []
    for call in calls:
        cuda = [t for t in (ms(m, call) for m in ("cuda", "cuda-batch", "cuda-batch-wide")) if t]
        got = {"eager": ms("eager", call), "aot": ms("aot", call), "cuda": min(cuda) if cuda else None}
        if got["aot"]:
            out.append((call, got))
    return out


def plot(shapes: Dict[str, Dict[str, dict]], dst: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(shapes), 1, figsize=(10, 3.6 * len(shapes)), squeeze=False)
    for ax, (shape, modes) in zip(axes[:, 0], shapes.items()):
        data = rows(modes)
        width = 0.27
        for i, (key, label) in enumerate(PATHS):
            xs = [j + (i - 1) * width for j in range(len(data))]
            ax.bar(xs, [d[key] or 0 for _, d in data], width, label=label, color=COLORS[key])
        for j, (_, d) in enumerate(data):
            if d["aot"] and d["cuda"]:
                ax.annotate("%.2fx" % (d["aot"] / d["cuda"]), (j, max(d["aot"], d["cuda"])), ha="center",
                            va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_ylim(top=ax.get_ylim()[1] * 1.8)  # room for the ratios over the tallest bars
        ax.set_ylabel("ms (log)")
        ax.set_xticks(range(len(data)))
        ax.set_xticklabels([c.replace(", ", "\n").replace(" at ", "\nat ") for c, _ in data], fontsize=8)
        ax.set_title("%s: laya-aot's time over laya-cuda's above each pair" % shape, fontsize=10)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    dst.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dst, dpi=110)


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("results", nargs="+", type=Path, help="peer.py's peer<tag>.json, one or more")
    ap.add_argument("--png", type=Path, help="where the plot goes (default: peer_calls<tag>.png in --out)")
    ap.add_argument("--title", default="laya eager, laya-aot and laya-cuda, one GPU, one run per checkpoint")
    a = ap.parse_args()
    shapes: Dict[str, Dict[str, dict]] = {}
    for path in a.results:
        for shape, s in json.loads(path.read_text())["shapes"].items():
            shapes[shape] = s["modes"]
    dst = a.png or a.out / ("peer_calls%s.png" % a.tag)
    plot(shapes, dst, a.title)
    print("wrote", dst)


if __name__ == "__main__":
    main()

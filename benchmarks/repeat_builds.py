"""Repeat builds of one checkpoint rank its artifacts the same? (issue 58: the artifact that serves was picked from one
noisy build-time timing.)

Builds the checkpoint --builds times for the CPU, one after another, each with the same command, optionally beside
--busy processes spinning on the CPU (a shared machine), and reports each build's latencies (the mix the loader
ranks by, `Artifact.latency_ms`), the order `select.rank` puts the artifacts in and whether every build agrees:

    python benchmarks/repeat_builds.py --builds 5 --busy 1

The checkpoint defaults to the demo checkpoint made under --work (`laya-aot make-demo`); --checkpoint names another.
"""
from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import harness


def spin(stop: Any) -> None:
    """A busy neighbour: pure Python arithmetic until told to stop."""
    x = 0
    while not stop.is_set():
        x = (x * 31 + 7) % 1000003


def build(ckpt: Path, out: Path, extra: List[str]) -> Dict[str, Any]:
    from laya_aot import kinds
    from laya_aot.bundle_format import parse_bundle
    from laya_aot.runtime.select import rank

    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "laya_aot.cli", "build", "--quiet", "checkpoint.path=%s" % ckpt,
                        "output_dir=%s" % out, "target=cpu", "overwrite=true", *extra], capture_output=True, text=True)
    if p.returncode != 0:
        return {"error": (p.stdout + p.stderr)[-2000:]}
    bundle = parse_bundle((out / "bundle.json").read_bytes(), kinds.BY_NAME, str(out / "bundle.json"))
    serving = [a for a in bundle.artifacts if a.status == "verified" and a.latency_ms.get("cpu")]
    ordered, _ = rank(serving, "cpu")
    return {"seconds": round(time.time() - t0, 1), "order": [a.name for a in ordered],
            "latency_ms": {a.name: a.latency_ms["cpu"] for a in serving},
            "spread_ms": {a.name: getattr(a, "latency_spread_ms", {}).get("cpu") for a in serving}}


def ranking(b: Dict[str, Any]) -> tuple:
    """A build's ranking as the loader reads it: the artifacts within MIX_TIE of the fastest sum are one tier
    (among those, the start recorded on the serving machine decides: `select.rank`), the rest in order."""
    from laya_aot.runtime.select import MIX_TIE

    sums = {n: sum(m.values()) for n, m in b.get("latency_ms", {}).items()}
    order = b.get("order", [])
    if not order:
        return ()
    best = sums[order[0]]
    tier = frozenset(n for n in order if sums[n] <= best * (1 + MIX_TIE))
    return (tier,) + tuple(n for n in order if n not in tier)


def markdown(r: Dict[str, Any]) -> str:
    lines = ["%d builds of %s for the CPU, %d busy neighbour process(es); each build's ranking (fastest mix first) "
             "and its latencies (ms per shape):" % (len(r["builds"]), r["checkpoint"], r["busy"]), "",
             "| build | order | latencies |", "|---|---|---|"]
    for i, b in enumerate(r["builds"]):
        lat = "; ".join("%s %s" % (n, " / ".join("%g" % v for v in m.values())) for n, m in
                        b.get("latency_ms", {}).items())
        lines.append("| %d | %s | %s |" % (i + 1, " > ".join(b.get("order", [])) or b.get("error", "")[:80], lat))
    lines += ["", "Every build gives the same order: **%s**; the same ranking as the loader reads it (the artifacts "
              "within 5%% of the fastest sum as one tier, the rest in order): **%s**."
              % ("yes" if r["same"] else "no", "yes" if r["same_tiers"] else "no")]
    return "\n".join(lines)


def main() -> None:
    ap = harness.parser(__doc__, work=True)
    ap.add_argument("--checkpoint", help="a Laya checkpoint directory (default: the demo checkpoint, made in --work)")
    ap.add_argument("--builds", type=int, default=5)
    ap.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU during the builds")
    ap.add_argument("--build-args", default="stages.inductor_cache=false")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = Path(a.checkpoint) if a.checkpoint else work / "checkpoint"
    if not a.checkpoint and not (ckpt / "model.safetensors").exists():
        subprocess.check_call([sys.executable, "-m", "laya_aot.cli", "make-demo", str(ckpt)])
    stop = multiprocessing.Event()
    busy = [multiprocessing.Process(target=spin, args=(stop,), daemon=True) for _ in range(a.busy)]
    for p in busy:
        p.start()
    builds = []
    try:
        for i in range(a.builds):
            builds.append(build(ckpt, work / "bundle", a.build_args.split()))
            print("build %d: %s" % (i + 1, json.dumps(builds[-1])[:300]), flush=True)
    finally:
        stop.set()
        for p in busy:
            p.join(5)
    orders = {tuple(b.get("order", ())) for b in builds}
    ok = all("error" not in b for b in builds)
    result = {"checkpoint": str(ckpt), "busy": a.busy, "builds": builds, "same": len(orders) == 1 and ok,
              "same_tiers": len({ranking(b) for b in builds}) == 1 and ok}
    harness.write(Path(a.out), "repeat_builds" + a.tag, result, markdown(result),
                  title="Repeat builds of one checkpoint: the same ranking?")


if __name__ == "__main__":
    main()

"""Where a fresh process's seconds go before laya's eager module exists (issue 20: TileLang's own start).

    python3 benchmarks/investigations/eager_module_start.py --ckpt DIR --out DIR [--device cuda] [--tag T]

On the H200, laya's module for the `tiny` checkpoint took 10.4 s in a TileLang start (`eager_module_s`) and the
build's load stage 11-12 s, against 2.2 s on a 2-core CPU machine: imports, not weights. Each run here is a fresh
interpreter under `-X importtime` that times, in order: import torch; CUDA initialisation; import laya and
laya_aot; a thin agent (laya's constructor, no weights); laya's eager module (`build_eager_module`), then the same
again (what is left once every import is done); import tilelang. Runs: twice as is (the second with a warm page
cache), then with HF_HUB_OFFLINE=1 (a hub lookup that waits for a network would show there). Writes
`eager_module_start{tag}.json` and `.md`: each run's phases and, per phase, the imports that took longest.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

CHILD = r"""
import json, sys, time
t0 = time.perf_counter(); last = t0; phases = {}
def mark(name):
    global last
    now = time.perf_counter(); phases[name] = round(now - last, 3); last = now
    sys.stderr.write("PHASE " + name + "\n"); sys.stderr.flush()
ckpt, device = sys.argv[1], sys.argv[2]
import torch; mark("import_torch")
if device == "cuda":
    torch.zeros(1, device="cuda"); torch.cuda.synchronize()
mark("cuda_init")
import laya, laya_aot; mark("import_laya")
from laya_aot import laya_internals as L
agent = L.thin_agent(ckpt, device=device); mark("thin_agent")
model = L.build_eager_module(agent, ckpt); mark("eager_module")
model = L.build_eager_module(agent, ckpt); mark("eager_module_again")
try:
    import tilelang
except Exception as e:  # noqa: BLE001 - a machine without tilelang still reports the rest
    phases["tilelang_error"] = repr(e)[:200]
mark("import_tilelang")
print("PHASES " + json.dumps(phases))
"""

LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def _imports(stderr: str) -> Dict[str, List[Dict[str, Any]]]:
    """Per phase, the imports it made: name, nesting depth, self and cumulative ms."""
    out: Dict[str, List[Dict[str, Any]]] = {}
    rows: List[Dict[str, Any]] = []
    for line in stderr.splitlines():
        if line.startswith("PHASE "):
            out[line[6:].strip()] = rows
            rows = []
            continue
        m = LINE.match(line)
        if m:
            rows.append({"module": m.group(4), "depth": len(m.group(3)) // 2, "self_ms": int(m.group(1)) / 1000,
                         "cum_ms": int(m.group(2)) / 1000})
    return out


def _run(ckpt: str, device: str, env_extra: Dict[str, str]) -> Dict[str, Any]:
    env = dict(os.environ, **env_extra)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", CHILD, ckpt, device], env=env,
                       capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    phases = {}
    for line in p.stdout.splitlines():
        if line.startswith("PHASES "):
            phases = json.loads(line[7:])
    imports = _imports(p.stderr)
    top = {ph: sorted(rows, key=lambda r: -r["cum_ms"])[:15] for ph, rows in imports.items()}
    sums = {ph: round(sum(r["self_ms"] for r in rows), 1) for ph, rows in imports.items()}
    return {"env": env_extra, "rc": p.returncode, "wall_s": round(wall, 3), "phases": phases,
            "import_self_ms_by_phase": sums, "top_imports_by_phase": top,
            "stderr_tail": "\n".join(x for x in p.stderr.splitlines() if not x.startswith("import time"))[-2000:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    runs = [_run(a.ckpt, a.device, env) for env in ({}, {}, {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"eager_module_start{a.tag}.json").write_text(json.dumps(runs, indent=1))
    md = ["| run | env | wall s | " + " | ".join(runs[0]["phases"]) + " |",
          "|---|---|---|" + "---|" * len(runs[0]["phases"])]
    for i, r in enumerate(runs):
        md.append(f"| {i + 1} | {r['env'] or '-'} | {r['wall_s']} | "
                  + " | ".join(str(r["phases"].get(k, "")) for k in runs[0]["phases"]) + " |")
    md.append("")
    for ph, rows in runs[1]["top_imports_by_phase"].items():
        md.append(f"run 2, {ph}: imports' own time {runs[1]['import_self_ms_by_phase'][ph]} ms; longest (cumulative):")
        md += [f"  {r['cum_ms']:9.1f} ms  {'  ' * r['depth']}{r['module']}" for r in rows[:10]]
    (out / f"eager_module_start{a.tag}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()

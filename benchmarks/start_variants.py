"""Later starts of a bundle under variants of how the weights reach the GPU, interleaved (issue 20).

On the GPU host, after the .device-site unpack line, with the checkpoint and bundle `gpu_start.py` makes:

    python3 benchmarks/start_variants.py --out $OUT [--reps 3] [--tag _run1]

Each start is a fresh `python3 -c` as in `gpu_start.py` (import, load, one answer; the parent's clock at spawn
to the child's at its first answer), preceded by a one-line prelude that picks the variant:
- `pinned`: the file read through two pinned buffers (`checkpoint.PINNED`, the default);
- `mapped`: copied from the file's memory map (pageable memory; the code before this change);
- `+switch`: `sys.setswitchinterval(0.0005)` for the whole process (the head start's threads wait less for
  the GIL while laya's load holds it).
One untimed start first fills the probe cache and the page cache. Then `weights alone`: the same
`Weights.load_to` of every constant in a process doing nothing else, each variant, to separate the copy's
own cost from what the threads beside it cost. Writes start_variants<tag>.json and .md to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_start import ONE, START, spawn_start  # noqa: E402

PRELUDE = {"pinned": "", "mapped": "import laya_aot.checkpoint as _c; _c.PINNED = False\n",
           "pinned+switch": "import sys; sys.setswitchinterval(0.0005)\n",
           "mapped+switch": "import sys; sys.setswitchinterval(0.0005)\n"
                            "import laya_aot.checkpoint as _c; _c.PINNED = False\n"}
ALONE = """
import json, time, torch
{prelude}from laya_aot import checkpoint
from laya_aot.kinds.aoti import CONSTANTS
spec = json.loads(open({bundle!r} + "/" + {art!r} + "/" + CONSTANTS).read())
targets = {{s["key"]: getattr(torch, s["dtype"]) for s in spec["constants"].values() if s["source"] == "model"}}
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t = time.perf_counter(); got = checkpoint.Weights({ckpt!r}).load_to(targets, "cuda"); torch.cuda.synchronize()
print("ALONE", time.perf_counter() - t, sum(v.numel() * v.element_size() for v in got.values()))
"""
KEYS = ("first_answer_s", "agent_load_s", "select_s", "weights_prepared_early_s", "weights_prepared_after_s",
        "load_package_s", "constants_wait_s", "constants_s", "warm_up_s", "loaded_early_after_s",
        "probe_wait_after_laya_load_s", "smoke_check_s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/laya-large-1024-fp16")
    ap.add_argument("--bundle", default="/tmp/bundle-large-1024-fp16")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default="pinned,mapped,pinned+switch,mapped+switch")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    variants = a.variants.split(",")
    env = dict(os.environ, LAYA_AOT_CACHE_DIR="/tmp/laya-aot-variants-cache", PYTHONUNBUFFERED="1")
    code = START.format(ckpt=a.ckpt, bundle=a.bundle, q=ONE, device="cuda")
    res: dict = {"command": " ".join(sys.argv), "untimed_first": spawn_start(code, env, 300), "starts": [],
                 "alone": []}
    for rep in range(a.reps):
        for v in variants:
            r = spawn_start(PRELUDE[v] + code, env, 300)
            r.update(variant=v, rep=rep)
            res["starts"].append(r)
            print(v, rep, r.get("first_answer_s"), r.get("rc"), (r.get("stderr") or "")[-400:], flush=True)
    art = json.loads((Path(a.bundle) / "bundle.json").read_text())["artifacts"]
    art = next(x["path"] for x in art if x["kind"] == "aoti" and x.get("device") == "cuda")
    for rep in range(a.reps):
        for v in ("pinned", "mapped"):
            t0 = time.time()
            p = subprocess.run([sys.executable, "-c", ALONE.format(prelude=PRELUDE[v], bundle=a.bundle, art=art,
                                                                   ckpt=a.ckpt)],
                               capture_output=True, text=True, env=env, timeout=300)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("ALONE ")), None)
            res["alone"].append({"variant": v, "rep": rep, "rc": p.returncode, "process_s": round(time.time() - t0, 3),
                                 "load_to_s": round(float(line.split()[1]), 3) if line else None,
                                 "bytes": int(line.split()[2]) if line else None,
                                 "stderr": p.stderr[-800:] if p.returncode else ""})
            print("alone", res["alone"][-1], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ("start_variants%s.json" % a.tag)).write_text(json.dumps(res, indent=1, default=str))
    (out / ("start_variants%s.md" % a.tag)).write_text(markdown(res, variants))
    print(markdown(res, variants))


def _med(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return round(statistics.median(xs), 3) if xs else None


def markdown(res: dict, variants) -> str:
    lines = ["| variant | n | " + " | ".join(KEYS) + " |", "|---|---|" + "---|" * len(KEYS)]
    for v in variants:
        rs = [r for r in res["starts"] if r.get("variant") == v and r.get("rc") == 0]
        row = [_med([(r if k == "first_answer_s" else r.get("load_stats", {})).get(k) for r in rs]) for k in KEYS]
        lines.append("| %s | %d | %s |" % (v, len(rs), " | ".join("-" if x is None else str(x) for x in row)))
    lines += ["", "Weights alone (`load_to` of every constant, nothing else in the process), median seconds:", ""]
    for v in ("pinned", "mapped"):
        xs = [r["load_to_s"] for r in res["alone"] if r["variant"] == v]
        b = next((r["bytes"] for r in res["alone"] if r["variant"] == v and r["bytes"]), None)
        lines.append("- %s: %s s (%s; %s bytes)" % (v, _med(xs), xs, b))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

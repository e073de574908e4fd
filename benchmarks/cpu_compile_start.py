"""The compile route's start on the CPU, before and after precompiled functions (issue 20, item 4).

    PYTHONPATH=. python benchmarks/cpu_compile_start.py --ckpt /tmp/laya-tiny --work /tmp/compile-start --runs 5

Builds both formats of the compile route's artifact from one checkpoint (the build stage runs for CUDA targets
only, so this drives its halves directly, as tests/kinds/test_compile_artifact.py does): `inductor_cache` (what
the route shipped before: a saved Inductor cache, Dynamo and AOTAutograd still run at the first call) and
`precompiled` (torch's saved function). Then starts fresh processes, alternating the two formats run by run,
each: import, laya's module as the loader builds it (`laya_internals.eager_agent`), the kind's load, one answer.
Start to first answer is the parent's clock at spawn to the child's at its answer.

Two machine states per format: `cold`, every process with empty Inductor and Triton caches (a new machine: on
the CPU, both formats compile their kernels' C++ there; on a GPU the precompiled function carries its Triton
kernels), and `warm`, processes sharing one cache directory that an untimed first start filled (a restart).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FORMATS = ("inductor_cache", "precompiled")


def child(art: str, ckpt: str) -> None:
    import torch

    from laya_aot import kinds
    from laya_aot import laya_internals as laya_api
    from laya_aot.kinds.inductor_cache import COMPILE_KEYS, _batch, compile_counters

    agent = laya_api.eager_agent(ckpt, device="cpu")
    t0 = time.perf_counter()
    runner = kinds.get("compile").load(Path(art), None, kinds.LoadEnv(device="cpu", model=agent.model))
    runner(*_batch(2, 32, 2, "cpu"))
    t_first = time.time()
    counts = compile_counters()
    print("FIRST %.6f %s" % (t_first, json.dumps({"load_and_first_call_s": round(time.perf_counter() - t0, 3),
                                                  "traces_and_compiles": {k: counts[k] for k in COMPILE_KEYS},
                                                  "torch": torch.__version__})), flush=True)


def build(ckpt: Path, work: Path) -> None:
    import laya
    import torch

    from laya_aot.kinds.inductor_cache import build_cache, build_precompiled
    from laya_aot.padding import Ranges

    agent = laya.load(str(ckpt), device="cpu")
    ranges = Ranges(1, 8, 16, int(agent.cfg.get("max_len", 256)), 2, 64)
    for fmt, make in zip(FORMATS, (build_cache, build_precompiled)):
        if not (work / fmt / "compile.json").exists():
            torch._dynamo.reset()
            t0 = time.time()
            make(agent, work / fmt, ranges, "fp32", "fp32", device="cpu")
            print("built %s in %.1f s" % (fmt, time.time() - t0), flush=True)


def start(fmt: str, ckpt: Path, work: Path, cache: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
               TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    t0 = time.time()
    p = subprocess.run([sys.executable, __file__, "--child", str(work / fmt), "--ckpt", str(ckpt)],
                       capture_output=True, text=True, env=env)
    line = next((x for x in p.stdout.splitlines() if x.startswith("FIRST ")), None)
    if p.returncode or not line:
        raise RuntimeError("%s: exit %d: %s" % (fmt, p.returncode, p.stderr[-2000:]))
    _, t_first, facts = line.split(" ", 2)
    return {"start_to_first_s": round(float(t_first) - t0, 3), **json.loads(facts)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--ckpt", default="/tmp/laya-tiny")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--work", default="/tmp/laya-aot-compile-start")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--states", default="warm,cold")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.ckpt)
        return
    ckpt, work = Path(a.ckpt), Path(a.work)
    if not ckpt.exists():
        subprocess.check_call([sys.executable, "-m", "laya_aot.cli", "make-demo", str(ckpt), "--shape", a.shape])
    work.mkdir(parents=True, exist_ok=True)
    build(ckpt, work)
    results = {}
    for state in a.states.split(","):
        runs = {fmt: [] for fmt in FORMATS}
        with tempfile.TemporaryDirectory(prefix="compile-start-") as tmp:
            if state == "warm":  # an untimed start of each fills the shared cache, as a first start would
                for fmt in FORMATS:
                    start(fmt, ckpt, work, os.path.join(tmp, fmt))
            for i in range(a.runs):
                for fmt in FORMATS:  # alternating, so drift on a shared machine hits both alike
                    cache = os.path.join(tmp, fmt) if state == "warm" else tempfile.mkdtemp(dir=tmp)
                    r = start(fmt, ckpt, work, cache)
                    runs[fmt].append(r)
                    print(state, fmt, i, json.dumps(r), flush=True)
        results[state] = {fmt: {"median_start_to_first_s": statistics.median(x["start_to_first_s"] for x in rs),
                                "median_load_and_first_call_s": statistics.median(x["load_and_first_call_s"]
                                                                                  for x in rs),
                                "runs": rs} for fmt, rs in runs.items()}
    text = json.dumps({"command": " ".join(sys.argv), "results": results}, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()

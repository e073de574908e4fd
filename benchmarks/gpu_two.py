"""Two GPUs of one host: agents on cuda:0 and cuda:1 in one process, called concurrently.

On a host with two GPUs:

    python3 benchmarks/gpu_two.py [--name hd16-16heads-fp16] [--calls 200]

Builds an AOTInductor bundle for this GPU, loads it into one agent per GPU in the same process (each with
its probe child and CUDA graphs), and laya's eager agent on each GPU. Two threads then call their own
agent at the same time; afterwards the script records each backend's CUDA-graph captures and replays,
any graph refusals, and how each agent's answers compare with laya eager on the same GPU (decisions
equal, largest probability difference). Writes gpu_two<tag>.json/.md to --out.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
import warnings

import harness


def main() -> int:
    p = harness.parser(__doc__, work=True)
    p.add_argument("--name", default="hd16-16heads-fp16")
    p.add_argument("--calls", type=int, default=200)
    a = p.parse_args()
    work = a.work
    environment = harness.environment()
    import numpy as np
    import torch

    from laya_aot.demo import make_checkpoint, question_suite, state_text

    assert torch.cuda.device_count() >= 2, "needs two GPUs, this host has %d" % torch.cuda.device_count()
    ckpt = make_checkpoint(work / "ckpt", a.name, seed=7)
    bundle = work / "bundle"
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "laya_aot.cli", "build", "checkpoint.path=%s" % ckpt, "target=sm_90",
                    "output_dir=%s" % bundle, "stages.onnx=false", "stages.tilelang=false",
                    "stages.inductor_cache=false"], check=True, capture_output=True)
    build_s = time.time() - t0
    import laya

    import laya_aot
    from laya_aot.laya_internals import serving_dtype

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        agents = {d: laya_aot.load(str(ckpt), bundle=str(bundle), device=d, prefer="aoti", strict=True)
                  for d in ("cuda:0", "cuda:1")}
    eagers = {d: laya.load(str(ckpt), device=d) for d in agents}
    qs = dict(list(question_suite().items())[::3])
    rng = np.random.default_rng(3)
    states = [state_text(rng, n) for n in (6, 25)]
    results = {d: [] for d in agents}
    errors = []
    start = threading.Barrier(len(agents))

    def worker(d):
        try:
            torch.cuda.set_device(0)  # both threads keep cuda:0 current: the runner must still use its own GPU
            start.wait()
            for _ in range(a.calls):
                results[d].append(agents[d].predict_batch(states, qs))
        except Exception as e:  # noqa: BLE001 - reported in the results
            errors.append("%s: %s: %s" % (d, type(e).__name__, e))

    threads = [threading.Thread(target=worker, args=(d,)) for d in agents]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - t0
    report = {"environment": environment, "checkpoint": a.name,
              "build_s": round(build_s, 1), "calls_per_agent": a.calls, "concurrent_wall_s": round(wall, 2),
              "errors": errors, "warnings": [str(w.message)[:300] for w in caught], "agents": {}}
    for d, agent in agents.items():
        ref = eagers[d].predict_batch(states, qs)
        same = total = 0
        worst = 0.0
        for res in results[d]:
            for g, r in zip(res, ref):
                for qid, b in r["answers"].items():
                    x = g["answers"][qid]
                    total += 1
                    same += harness.decision(x) == harness.decision(b)
                    pa = dict(x.get("probabilities") or {}, act=x["action"]["act_probability"])
                    pb = dict(b.get("probabilities") or {}, act=b["action"]["act_probability"])
                    worst = max([worst] + [abs(pa[k] - pb[k]) for k in pb])
        bo = agent.backend_object
        report["agents"][d] = {"backend": agent.backend, "serves": serving_dtype(agent),
                               "runner_device": str(bo.runner.device), "cuda_graphs": bo.stats.get("cuda_graphs"),
                               "graphs_off": bo.load_stats.get("cuda_graphs_off"),
                               "probe": bo.load_stats.get("probe"), "decisions_equal": same, "decisions": total,
                               "max_prob_diff_vs_eager": worst, "artifact_tolerance": bo.verify.tolerance}
    lines = ["| device | backend | serves | graph captures / replays / refusals | decisions = eager | max prob diff | "
             "errors |", "|---|---|---|---|---|---|---|"]
    for d, r in report["agents"].items():
        g = r["cuda_graphs"] or {}
        lines.append("| %s | %s | %s | %s / %s / %s | %d/%d | %.3g | %d |" % (
            d, r["backend"], r["serves"], g.get("captured", 0), g.get("replays", 0), g.get("refusals", 0),
            r["decisions_equal"], r["decisions"], r["max_prob_diff_vs_eager"], len(errors)))
    lines.append("\n%d calls per agent, both threads at once: %.2f s. Warnings at load: %s"
                 % (a.calls, wall, report["warnings"] or "none"))
    harness.write(a.out, "gpu_two" + a.tag, report, "\n".join(lines), title="Two GPUs in one process")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())

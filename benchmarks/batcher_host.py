"""The host work per request of the Python batcher (`laya_aot.Batcher`), its artifact stubbed: requests/s and
CPU microseconds per request at 1 / 8 / 32 concurrent callers, and where a request's host time goes at 32.

    python benchmarks/batcher_host.py --checkpoint CKPT --bundle BUNDLE [--callers 1,8,32] [--seconds 5]

Loads the bundle as `laya_aot.load` does and replaces the artifact by a stand-in of the right output shapes
(slices of fixed seeded logits and action outputs, copied: a few microseconds), so that only the host work is
timed: the batcher's queueing and futures, laya's tokenising and collation, padding, the backend's host side,
decoding and splitting the answers back. Callers send short single requests in a closed loop (the demo's three
states and three questions: http_load's `short` stream), each waiting for its answer.

Per level: requests/s; wall microseconds per request (1e6 / requests/s: the ceiling the host puts on one
process); CPU microseconds per request, of the whole process and of the batcher's worker thread alone (from
/proc's per-thread counters, so a machine shared with other work moves them less than the wall figures);
requests per merged call. At the last level, the worker's CPU time by step (thread CPU clocks around each step,
exclusive of the steps inside it) and, with --profile, the worker's top functions under cProfile (a separate
run: the profiler slows what it measures). Writes batcher_host<tag>.json and .md to --out.
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time
from typing import Any, Callable, Dict, List

import harness
from host_breakdown import Clock, instrument

sys.path.insert(0, str(harness.ROOT))

# the worker's steps (host_breakdown's components of a predict_batch call, and the batcher's own)
STEPS = ("take", "settle", "predict_batch", "prepare", "encode_state", "build_head", "collate", "infer", "backend",
         "artifact", "decode")


def stub_runner(backend: Any, seed: int = 0) -> Callable[..., Any]:
    """A stand-in for the backend's artifact: the real outputs' dtypes and widths (from one real call), each call's
    rows sliced from fixed seeded values and copied, as an artifact returns new tensors."""
    import torch

    runner = backend.runner
    probe = [torch.zeros((1, 16), dtype=torch.long), torch.ones((1, 16), dtype=torch.long),
             torch.tensor([[1, 2, 3, 4]]), torch.ones((1, 4), dtype=torch.bool), torch.zeros((1,), dtype=torch.long)]
    lo, ac = runner(*probe)
    g = torch.Generator().manual_seed(seed)
    rows, width = 4096, 64
    logits = (torch.randn((rows, width), generator=g) * 3).to(lo.dtype)
    acts = torch.randn((rows, ac.shape[1]), generator=g).to(ac.dtype)

    def stub(ids: Any, att: Any, mpos: Any, mmask: Any, qtype: Any) -> Any:
        n, k = mpos.shape
        return logits[:n, :k].clone(), acts[:n].clone()

    for attr in ("device", "takes_host_inputs", "graphs"):
        if hasattr(runner, attr):
            setattr(stub, attr, getattr(runner, attr))
    return stub


def thread_cpu_ns(native_id: int) -> int:
    """A thread's CPU time so far (ns), from /proc's scheduler counters."""
    with open("/proc/self/task/%d/schedstat" % native_id) as f:
        return int(f.read().split()[0])


def level(batcher: Any, reqs: List[Dict[str, Any]], callers: int, seconds: float) -> Dict[str, Any]:
    """One closed-loop level (http_load's in-process callers), with the CPU it took."""
    from http_load import _callers

    worker = batcher._thread.native_id
    calls0 = dict(batcher.stats.snapshot()["calls"])
    cpu0, w0 = time.process_time(), thread_cpu_ns(worker)
    lv = _callers(lambda r: batcher.submit(r["state"], r["questions"]).result(), reqs, callers, seconds)
    cpu, wcpu = time.process_time() - cpu0, (thread_cpu_ns(worker) - w0) / 1e9
    calls = batcher.stats.snapshot()["calls"]
    n = max(1, lv["ok"])
    made = sum(calls[k] - calls0.get(k, 0) for k in ("merged", "alone"))
    lv.pop("answers")
    return dict(lv, wall_us_per_request=round(1e6 / max(lv["rps"], 1e-9), 1),
                cpu_us_per_request=round(cpu * 1e6 / n, 1), worker_cpu_us_per_request=round(wcpu * 1e6 / n, 1),
                requests_per_call=round(n / max(1, made), 2))


def steps(batcher: Any, agent: Any, reqs: List[Dict[str, Any]], callers: int, seconds: float) -> Dict[str, Any]:
    """The worker's CPU time per request by step at `callers` callers (thread CPU clocks; exclusive)."""
    clock = Clock(timer=time.thread_time)
    instrument(agent, clock, stub=False)  # the stand-in is installed already: timed as the artifact
    batcher._take = clock.wrap("take", batcher._take)
    batcher._settle = clock.wrap("settle", batcher._settle)
    target = batcher.target
    target.agent.predict_batch = clock.wrap("predict_batch", target.agent.predict_batch)
    worker = batcher._thread.native_id
    w0 = thread_cpu_ns(worker)
    lv = level(batcher, reqs, callers, seconds)
    total = (thread_cpu_ns(worker) - w0) / 1e3
    n = max(1, lv["ok"])
    out = {s: round(clock.spent.get(s, 0.0) * 1e6 / n, 1) for s in STEPS}
    out["worker_rest"] = round(total / n - sum(out.values()), 1)  # the worker loop, futures, stats, the Work
    out["worker_total"] = round(total / n, 1)
    out["callers"] = round(lv["cpu_us_per_request"] - total / n, 1)  # submit, Work, Future.result, the loop
    return {"level": lv, "us_per_request": out}


def profile(batcher: Any, reqs: List[Dict[str, Any]], callers: int, seconds: float, top: int) -> str:
    """The worker thread's top functions by own time under cProfile (enabled on the worker by a job)."""
    prof = cProfile.Profile()
    batcher.submit_job(prof.enable).result()
    lv = level(batcher, reqs, callers, seconds)
    batcher.submit_job(prof.disable).result()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return "requests: %d\n%s" % (lv["ok"], text.getvalue())


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--checkpoint", required=True, help="a Laya checkpoint dir")
    ap.add_argument("--bundle", required=True, help="a bundle built from --checkpoint")
    ap.add_argument("--callers", default="1,8,32")
    ap.add_argument("--seconds", type=float, default=5.0, help="per level")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds of load before the levels")
    ap.add_argument("--rounds", type=int, default=1, help="levels repeated, interleaved (the median is reported)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="also the worker's top N functions")
    a = ap.parse_args()
    from http_load import short_requests

    import laya_aot
    from laya_aot.runtime.batcher import Batcher

    environment = harness.environment()
    agent = laya_aot.load(a.checkpoint, bundle=a.bundle, device="cpu")
    backend = agent.backend_object
    backend.runner = stub_runner(backend)
    reqs = short_requests()
    callers = [int(x) for x in a.callers.split(",")]
    result: Dict[str, Any] = {"environment": environment, "checkpoint": a.checkpoint, "backend": agent.backend,
                              "seconds": a.seconds, "threads": os.environ.get("LAYA_THREADS")}
    with Batcher(agent) as batcher:
        level(batcher, reqs, max(callers), a.warmup)
        runs: Dict[int, List[Dict[str, Any]]] = {c: [] for c in callers}
        for _ in range(a.rounds):
            for c in callers:
                runs[c].append(level(batcher, reqs, c, a.seconds))
        result["levels"] = [median_level(runs[c]) for c in callers]
        result["steps"] = steps(batcher, agent, reqs, max(callers), a.seconds)
        if a.profile:
            result["profile"] = profile(batcher, reqs, max(callers), a.seconds, a.profile)
    result["host_path"] = agent.backend_object.stats.get("host_path")
    harness.write(a.out, "batcher_host" + a.tag, result, markdown(result),
                  title="The Python batcher's host work per request (artifact stubbed)")
    return 0


def median_level(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The run of median requests/s of one level, with every run's requests/s."""
    ranked = sorted(runs, key=lambda r: r["rps"])
    return dict(ranked[len(ranked) // 2], rps_runs=[r["rps"] for r in runs])


def markdown(r: Dict[str, Any]) -> str:
    lines = ["| callers | requests/s | wall us per request | CPU us per request | worker CPU us per request | "
             "requests per call | p50 ms | p99 ms |", "|---|---|---|---|---|---|---|---|"]
    for lv in r["levels"]:
        lines.append("| %d | %s | %s | %s | %s | %s | %s | %s |" % (
            lv["callers"], lv["rps"], lv["wall_us_per_request"], lv["cpu_us_per_request"],
            lv["worker_cpu_us_per_request"], lv["requests_per_call"], lv["p50_ms"], lv["p99_ms"]))
    st = r["steps"]
    lines += ["", "The worker's CPU time by step, us per request at %d callers (%s requests/s under the clocks):"
              % (st["level"]["callers"], st["level"]["rps"]), "",
              "| step | us per request |", "|---|---|"]
    lines += ["| %s | %s |" % kv for kv in st["us_per_request"].items()]
    if r.get("profile"):
        lines += ["", "```", r["profile"].rstrip(), "```"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

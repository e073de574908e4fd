"""The host work per request of the Python batcher (`laya_aot.Batcher`), its artifact stubbed: requests/s and
CPU microseconds per request at 1 / 8 / 32 concurrent callers, and where a request's host time goes at 32.

    python benchmarks/batcher_host.py --checkpoint CKPT --bundle BUNDLE [--callers 1,8,32] [--seconds 5]
    # on a GPU, the bundle's own artifact (its call's host side and the wait for the device included):
    python benchmarks/batcher_host.py --checkpoint CKPT --bundle BUNDLE --device cuda --artifact --out $OUT

Loads the bundle as `laya_aot.load` does and replaces the artifact by a stand-in of the right output shapes
(slices of fixed seeded logits and action outputs, copied: a few microseconds), so that only the host work is
timed: the batcher's queueing and futures, laya's tokenising and collation, padding, the backend's host side,
decoding and splitting the answers back. Callers send short single requests in a closed loop (the demo's three
states and three questions: http_load's `short` stream), each waiting for its answer; through two targets
(--targets): the agent itself (`Batcher(agent)`, the Python API) and a laya Router holding it (what `laya-aot
serve` batches: laya's routing and grouping per request besides).

Per level: requests/s; wall microseconds per request (1e6 / requests/s: the ceiling the host puts on one
process); CPU microseconds per request, of the whole process and of the batcher's worker thread alone (from
/proc's per-thread counters, so a machine shared with other work moves them less than the wall figures);
requests per merged call. At the last level, the worker's time by step, of its CPU (thread clocks) and of the
wall, each exclusive of the steps inside it, and, with --profile, the worker's top functions under cProfile (a
separate run: the profiler slows what it measures). --rounds repeats the levels interleaved (targets and caller
counts in turn) and reports the median. --isolated N: each target's call for 1 and for 16 requests made alone in
one thread N times, its CPU us per request (least and median): the worker's host work without the threads, the
figure a busy shared machine moves least. Writes batcher_host<tag>.json and .md to --out.
"""
from __future__ import annotations

import cProfile
import functools
import io
import os
import pstats
import sys
import threading
import time
from typing import Any, Callable, Dict, List

import harness
from host_breakdown import Clock, instrument

sys.path.insert(0, str(harness.ROOT))

# the worker's steps (host_breakdown's components of a predict_batch call, and the batcher's own)
STEPS = ("take", "settle", "router", "predict_batch", "prepare", "encode_state", "build_head", "collate", "infer",
         "backend", "artifact", "decode")


def stub_runner(backend: Any, seed: int = 0) -> Callable[..., Any]:
    """A stand-in for the backend's artifact: the real outputs' device, dtypes and widths (from one real call), each
    call's rows sliced from fixed seeded values and copied, as an artifact returns new tensors."""
    import torch

    runner = backend.runner
    dev = torch.device(getattr(runner, "device", "cpu"))
    probe = [torch.zeros((1, 16), dtype=torch.long), torch.ones((1, 16), dtype=torch.long),
             torch.tensor([[1, 2, 3, 4]]), torch.ones((1, 4), dtype=torch.bool), torch.zeros((1,), dtype=torch.long)]
    lo, ac = runner(*[x.to(dev) for x in probe])
    g = torch.Generator().manual_seed(seed)
    rows, width = 4096, 64
    logits = (torch.randn((rows, width), generator=g) * 3).to(device=lo.device, dtype=lo.dtype)
    acts = torch.randn((rows, ac.shape[1]), generator=g).to(device=ac.device, dtype=ac.dtype)

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


def tasks_cpu_ns() -> Dict[int, int]:
    """Every thread of this process and its CPU time so far (ns)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = thread_cpu_ns(int(tid))
        except (OSError, ValueError):  # ended meanwhile
            pass
    return out


def level(batcher: Any, reqs: List[Dict[str, Any]], callers: int, seconds: float) -> Dict[str, Any]:
    """One closed-loop level (http_load's in-process callers), with the CPU it took: of the process, of the
    batcher's worker, of the threads that outlive the level besides it and this one (native pools: the
    tokenizer's, torch's) and of the rest (the callers' threads, started and ended with the level)."""
    from http_load import _callers

    worker = batcher._thread.native_id
    calls0 = dict(batcher.stats.snapshot()["calls"])
    before = tasks_cpu_ns()
    cpu0, w0 = time.process_time(), thread_cpu_ns(worker)
    routed = getattr(batcher.target, "router", None) is not None  # the router is asked for the model by name

    def ask(r: Dict[str, Any]) -> Any:
        return batcher.submit(r["state"], r["questions"], **({"model": r["model"]} if routed else {})).result()

    ask(reqs[0])  # an error here is the run's, said at once (the loop below only counts errors)
    lv = _callers(ask, reqs, callers, seconds)
    cpu, wcpu = time.process_time() - cpu0, (thread_cpu_ns(worker) - w0) / 1e9
    after = tasks_cpu_ns()
    pools = sum(after[t] - before[t] for t in before.keys() & after.keys()
                if t not in (worker, threading.get_native_id())) / 1e9
    calls = batcher.stats.snapshot()["calls"]
    n = max(1, lv["ok"])
    made = sum(calls[k] - calls0.get(k, 0) for k in ("merged", "alone"))
    lv.pop("answers")
    return dict(lv, wall_us_per_request=round(1e6 / max(lv["rps"], 1e-9), 1),
                cpu_us_per_request=round(cpu * 1e6 / n, 1), worker_cpu_us_per_request=round(wcpu * 1e6 / n, 1),
                pools_cpu_us_per_request=round(pools * 1e6 / n, 1),
                requests_per_call=round(n / max(1, made), 2))


def steps(batcher: Any, clocks: Dict[str, Clock], reqs: List[Dict[str, Any]], callers: int, seconds: float,
          ) -> Dict[str, Any]:
    """The worker's time per request by step at `callers` callers, of its CPU (thread clocks) and of the wall
    (exclusive of the steps inside each; the wall includes waiting for the device and for the GIL)."""
    for clock in clocks.values():
        clock.spent.clear()
    worker = batcher._thread.native_id
    w0 = thread_cpu_ns(worker)
    lv = level(batcher, reqs, callers, seconds)
    total = (thread_cpu_ns(worker) - w0) / 1e3
    n = max(1, lv["ok"])
    out: Dict[str, Any] = {"level": lv}
    for name, clock in clocks.items():
        row = {s: round(clock.spent.get(s, 0.0) * 1e6 / n, 1) for s in STEPS}
        if name == "cpu":
            row["worker_rest"] = round(total / n - sum(row.values()), 1)  # the loop, futures, stats
            row["worker_total"] = round(total / n, 1)
            row["not_worker"] = round(lv["cpu_us_per_request"] - total / n, 1)  # callers, tokenizer threads
        out[name] = row
    return out


def instrument_all(agent: Any, batchers: List[Any]) -> Dict[str, Clock]:
    """Clocks of the worker's CPU time and of the wall around each step (host_breakdown's components, the
    router's own work and the batcher's), one wrapper of each around every step."""
    clocks = {"wall": Clock(), "cpu": Clock(timer=time.thread_time)}
    for clock in clocks.values():
        instrument(agent, clock, stub=False)  # a stand-in, when there is one, is installed already
        for batcher in batchers:
            batcher._take = clock.wrap("take", batcher._take)
            batcher._settle = clock.wrap("settle", batcher._settle)
        agent.predict_batch = clock.wrap("predict_batch", agent.predict_batch)
        for batcher in batchers:
            router = getattr(batcher.target, "router", None)
            if router is not None:
                router.predict_batch = clock.wrap("router", router.predict_batch)
                router.predict = clock.wrap("router", router.predict)
    return clocks


def profile(batcher: Any, reqs: List[Dict[str, Any]], callers: int, seconds: float, top: int) -> str:
    """The worker thread's top functions by own time under cProfile (enabled on the worker by a job)."""
    prof = cProfile.Profile()
    batcher.submit_job(prof.enable).result()
    lv = level(batcher, reqs, callers, seconds)
    batcher.submit_job(prof.disable).result()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return "requests: %d\n%s" % (lv["ok"], text.getvalue())


def isolated(batchers: Dict[str, Any], reqs: List[Dict[str, Any]], sizes: List[int], repeats: int
             ) -> Dict[str, Any]:
    """The merged call alone, in this thread: each target's call for `size` requests of the short stream (what its
    batcher's worker runs for a call of that many), `repeats` times; the thread's CPU us per request, the least
    (the run least disturbed by other work on the machine) and the median."""
    from laya_aot.runtime.batcher import Work

    out: Dict[str, Any] = {}
    for t, batcher in batchers.items():
        target = batcher.target
        routed = getattr(target, "router", None) is not None
        for size in sizes:
            works: List[Work] = [target.work(r["state"], r["questions"], {"model": r["model"]} if routed else {})
                                 for r in (reqs * (size // len(reqs) + 1))[:size]]
            call = (lambda w=works: [x.alone() for x in w]) if size == 1 else functools.partial(target.run, works)
            for _ in range(3):
                call()
            times = []
            for _ in range(repeats):
                t0 = time.thread_time()
                call()
                times.append((time.thread_time() - t0) * 1e6 / size)
            times.sort()
            out.setdefault(t, {})[size] = {"min_us_per_request": round(times[0], 1),
                                           "median_us_per_request": round(times[len(times) // 2], 1)}
    return out


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--checkpoint", required=True, help="a Laya checkpoint dir")
    ap.add_argument("--bundle", required=True, help="a bundle built from --checkpoint")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--artifact", action="store_true",
                    help="the bundle's own artifact (on a GPU: the call's host side and the wait included)")
    ap.add_argument("--targets", default="agent,router",
                    help="agent: Batcher(laya_aot.load(...)); router: Batcher over a laya Router holding it")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's intra-op threads (1: the host's small torch ops never wait at a parallel region's "
                         "barrier for a core that other work holds; what the artifact takes is set by the bundle)")
    ap.add_argument("--callers", default="1,8,32")
    ap.add_argument("--seconds", type=float, default=5.0, help="per level")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds of load before the levels")
    ap.add_argument("--rounds", type=int, default=1, help="levels repeated, interleaved (the median is reported)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="also the worker's top N functions")
    ap.add_argument("--isolated", type=int, default=200, metavar="N",
                    help="also each target's call for 1 and 16 requests alone, N times (0: not)")
    a = ap.parse_args()
    import torch
    from http_load import short_requests
    from laya.router import Router

    import laya_aot
    from laya_aot.runtime.batcher import Batcher

    torch.set_num_threads(a.threads)
    environment = harness.environment()
    agent = laya_aot.load(a.checkpoint, bundle=a.bundle, device=a.device)
    backend = agent.backend_object
    if not a.artifact:
        backend.runner = stub_runner(backend)
    reqs = short_requests()
    callers = [int(x) for x in a.callers.split(",")]
    top = max(callers)
    result: Dict[str, Any] = {"environment": environment, "checkpoint": a.checkpoint, "backend": agent.backend,
                              "artifact": "the bundle's" if a.artifact else "stand-in", "seconds": a.seconds,
                              "torch_threads": a.threads, "targets": {}}
    batchers = {}
    for name in a.targets.split(","):
        if name == "router":
            router = Router(device=a.device)
            router.attach("bench", agent)
            batchers[name] = Batcher(router, name="laya-aot-batcher-router")
        elif name == "agent":
            batchers[name] = Batcher(agent)
        else:
            raise SystemExit("unknown target %r: agent or router" % name)
    try:
        runs: Dict[str, Dict[int, List[Dict[str, Any]]]] = {t: {c: [] for c in callers} for t in batchers}
        for batcher in batchers.values():
            level(batcher, reqs, top, a.warmup)
        for _ in range(a.rounds):
            for c in callers:
                for t, batcher in batchers.items():
                    runs[t][c].append(level(batcher, reqs, c, a.seconds))
        if a.isolated:
            result["isolated"] = isolated(batchers, reqs, [1, 16], a.isolated)
        clocks = instrument_all(agent, list(batchers.values()))
        for t, batcher in batchers.items():
            result["targets"][t] = {"levels": [median_level(runs[t][c]) for c in callers],
                                    "steps": steps(batcher, clocks, reqs, top, a.seconds)}
        if a.profile:
            first = next(iter(batchers))
            result["targets"][first]["profile"] = profile(batchers[first], reqs, top, a.seconds, a.profile)
    finally:
        for batcher in batchers.values():
            batcher.close()
    result["host_path"] = agent.backend_object.stats.get("host_path")
    harness.write(a.out, "batcher_host" + a.tag, result, markdown(result),
                  title="The Python batcher's host work per request")
    return 0


def median_level(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The run of median requests/s of one level, with every run's requests/s."""
    ranked = sorted(runs, key=lambda r: r["rps"])
    return dict(ranked[len(ranked) // 2], rps_runs=[r["rps"] for r in runs])


def markdown(r: Dict[str, Any]) -> str:
    lines = ["Artifact: %s; torch threads %s. Short single requests (the demo's states and three questions), "
             "closed loop." % (r["artifact"], r["torch_threads"]), ""]
    for t, res in r["targets"].items():
        lines += ["Target: %s" % t, "",
                  "| callers | requests/s | wall us per request | CPU us per request | of which the worker | "
                  "native pools | requests per call | p50 ms | p99 ms |", "|---|---|---|---|---|---|---|---|---|"]
        for lv in res["levels"]:
            lines.append("| %d | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                lv["callers"], lv["rps"], lv["wall_us_per_request"], lv["cpu_us_per_request"],
                lv["worker_cpu_us_per_request"], lv["pools_cpu_us_per_request"], lv["requests_per_call"],
                lv["p50_ms"], lv["p99_ms"]))
        st = res["steps"]
        lines += ["", "The worker's time by step, us per request at %d callers (%s requests/s under the clocks; "
                  "exclusive of the steps inside):" % (st["level"]["callers"], st["level"]["rps"]), "",
                  "| step | CPU | wall |", "|---|---|---|"]
        lines += ["| %s | %s | %s |" % (k, v, st["wall"].get(k, "")) for k, v in st["cpu"].items()]
        if res.get("profile"):
            lines += ["", "```", res["profile"].rstrip(), "```"]
        lines.append("")
    if r.get("isolated"):
        lines += ["A target's call alone (one request: laya's own call for it; 16: the merged call), this thread's CPU "
                  "us per request, least / median:", "", "| target | 1 request | 16 requests |", "|---|---|---|"]
        for t, sizes in r["isolated"].items():
            lines.append("| %s | %s |" % (t, " | ".join("%s / %s" % (v["min_us_per_request"],
                                                                   v["median_us_per_request"])
                                                       for v in sizes.values())))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""Where one short call's time goes: laya-aot's bundle and laya-cuda's `Engine` on the same checkpoint and GPU.

    python benchmarks/one_call.py --ckpt CKPT --bundle BUNDLE [--runtimes aot,aot-laya-infer,cuda]

`aot-laya-infer` is laya-aot with laya's own `Agent._infer` (each input moved to the GPU apart, then the backend's
forward) in place of the collated batch handed to the backend on the host (`AOTBackend.host_call`);
`aot-laya-predict` is laya-aot with every call through laya's own `predict_batch` (no plain calls).
The call is `harness.CALLS`' 1x1 (one state of 20 words, one choice question). Each runtime in a fresh process:
- its first call after load, then the median of 200 calls, each synchronised;
- `torch.profiler` over 10 calls: kernels per call, the GPU's time in kernels per call, the kernels by GPU time
  (kernels_<runtime>.txt) and the trace (trace_<runtime>.json, for a timeline viewer);
- laya-aot only, the unprofiled split: the median time from the call's start at which each step of the way is
  entered and left (laya's `_forward` and `_infer`, the backend's `_forward` and `_call`, the CUDA graphs'
  call and replay, the decoding), with no synchronisation but the call's own.
laya-cuda needs `laya_cuda` importable (benchmarks/peer.py says how). Writes one_call<tag>.json and .md to --out.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict

import harness

CALLS = 200  # timed calls, after WARMUP
WARMUP = 30
PROFILED = 10


def _call(runtime: str, ckpt: str, bundle: str) -> Callable[[], Any]:
    state = harness.states(1, 20, seed=0)
    if runtime.startswith("aot"):
        import laya_aot

        agent = laya_aot.load(ckpt, bundle=bundle, device="cuda", strict=True)
        if runtime == "aot-laya-infer":
            agent.__dict__.pop("_infer")  # laya's own method again
        if runtime == "aot-laya-predict":
            agent.backend_object.host_path.plain = None  # every call through laya's own predict_batch
        return lambda: agent.predict_batch(state, harness.ONE)
    from laya_cuda import Engine

    engine = Engine(ckpt)
    return lambda: [engine.predict(state[0], harness.ONE)]


def _marked(marks: Dict[str, float]) -> None:
    """Record when each step of laya-aot's call is first entered and last left (perf_counter)."""
    import laya.agent

    from laya_aot.kinds import graphs
    from laya_aot.runtime import backend, host_steps

    def wrap(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            marks.setdefault(label + " in", time.perf_counter())
            out = inner(*args, **kwargs)
            marks[label + " out"] = time.perf_counter()
            return out

        setattr(owner, name, timed)

    for owner, name, label in ((laya.agent.Agent, "_forward", "laya _forward"),
                               (laya.agent.Agent, "_infer", "laya _infer"),
                               (backend.AOTBackend, "host_call", "backend host_call"),
                               (backend.AOTBackend, "_forward", "backend _forward"),
                               (backend.AOTBackend, "_call", "backend _call"),
                               (graphs.GraphedCalls, "__call__", "graphs"),
                               (graphs._Graph, "replay", "replay"),
                               (host_steps.Decoder, "__call__", "decode")):
        wrap(owner, name, label)


def child(runtime: str, ckpt: str, bundle: str, out: Path) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    call = _call(runtime, ckpt, bundle)
    t = time.perf_counter()
    call()
    torch.cuda.synchronize()
    res: Dict[str, Any] = {"runtime": runtime, "first_call_ms": round((time.perf_counter() - t) * 1e3, 3)}
    res["median_ms"] = round(harness.median_ms(call, repeats=CALLS, warmup=WARMUP, device="cuda"), 3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            call()
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(out / ("trace_%s.json" % runtime)))
    kernels = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    res["kernels_per_call"] = len(kernels) / PROFILED
    res["kernel_ms_per_call"] = round(sum(e.device_time_total for e in kernels) / PROFILED / 1e3, 3)
    (out / ("kernels_%s.txt" % runtime)).write_text(
        prof.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=100))
    if runtime.startswith("aot"):
        marks: Dict[str, float] = {}
        _marked(marks)
        rows = []
        for _ in range(WARMUP + CALLS):
            marks.clear()
            t = time.perf_counter()
            call()
            torch.cuda.synchronize()
            rows.append(dict({k: v - t for k, v in marks.items()}, end=time.perf_counter() - t))
        rows = rows[WARMUP:]
        steps = sorted(rows[-1], key=lambda k: rows[-1][k])
        res["split_us"] = {k: round(statistics.median(r[k] for r in rows if k in r) * 1e6, 1) for k in steps}
    harness.emit(res)


def markdown(res: Dict[str, Any]) -> str:
    lines = ["| runtime | first call ms | median ms | kernels per call | GPU ms in kernels per call |",
             "|---|---|---|---|---|"]
    for name, r in res["runtimes"].items():
        if "error" in r:
            lines.append("| %s | %s | | | |" % (name, r["error"]))
            continue
        lines.append("| %s | %.3f | %.3f | %.0f | %.3f |" % (name, r["first_call_ms"], r["median_ms"],
                                                            r["kernels_per_call"], r["kernel_ms_per_call"]))
    for name, r in res["runtimes"].items():
        if r.get("split_us"):
            lines += ["", "%s's call, unprofiled (median us from the call's start):" % name, "",
                      "| step | us |", "|---|---|"] + ["| %s | %.1f |" % kv for kv in r["split_us"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--runtimes", default="aot,cuda",
                    help="aot (laya_aot.load's default), aot-laya-infer / aot-laya-predict (the same with laya's own "
                         "_infer / predict_batch), cuda (laya-cuda Engine)")
    ap.add_argument("--child")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.child:
        child(a.child, a.ckpt, a.bundle, a.out)
        return
    res: Dict[str, Any] = {"environment": harness.environment(), "runtimes": {}}
    for runtime in a.runtimes.split(","):
        run = harness.spawn([sys.executable, __file__, "--child", runtime, "--ckpt", a.ckpt, "--bundle", a.bundle,
                             "--out", str(a.out)], timeout=600)
        res["runtimes"][runtime] = run.result_or_failure()
        print(runtime, json.dumps(res["runtimes"][runtime]), flush=True)
    harness.write(a.out, "one_call" + a.tag, res, markdown(res), title="Where one short call's time goes")


if __name__ == "__main__":
    main()

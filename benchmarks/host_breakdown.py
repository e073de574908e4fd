"""Where the host side of a `predict_batch` call goes, component by component.

    python benchmarks/host_breakdown.py --ckpt DIR --bundle DIR [--device cpu] [--repeats 25] [--stub]

Loads the bundle as `laya_aot.load` does (host path on unless `--stock-host`), then times the realistic calls
(`harness.CALLS`) with a wall-clock timer around each of laya's and laya-aot's steps. Each component is the
time inside that step less the time of the components inside it (exclusive time), in microseconds per call,
median over `--repeats` calls after 3 warm-ups; "rest" is the call's total less every component: laya's
predict_batch body (hooks, validation, the usage and result dicts, the confidence gate).

- prepare: the host path's batched state tokenisation (`HostPath.prepare`)
- encode_state: `Agent._encode_state` (the state's ids, `build_sequence` per question) less build_head
- build_head: the question heads (laya's, or the host path's cache)
- collate: `collate_items` (the padded arrays and tensors)
- infer: `Agent._infer`/`_forward` around the model call (locks, autocast, `.to(device)`, the outputs' copies
  to the CPU and the action softmax)
- backend: the installed forward (`AOTBackend.forward`: padding, chunking, counts) less the artifact
- artifact: the artifact's own calls (excluded from host)
- decode: `Agent._decode_answers` (temperatures, probabilities, the answer dicts)

`--stub` replaces the artifact by a function of the right shapes that costs a few microseconds, so the host
work is measured without the forward's noise (the answers then mean nothing; the host work is the same).
Writes host_breakdown<tag>.json and .md to --out.
"""
from __future__ import annotations

import statistics
import threading
import time

import harness
from harness import CALLS, states

COMPONENTS = ("prepare", "encode_state", "build_head", "collate", "infer", "backend", "artifact", "decode")


class Clock:
    """Exclusive wall time per named component: a stack of open components per thread, each charged its own
    time (one thread's open components never charge another's)."""

    def __init__(self, timer=time.perf_counter):
        self.timer = timer  # wall time; time.thread_time: the calling thread's CPU time
        self.spent: dict = {}
        self.local = threading.local()

    @property
    def stack(self) -> list:
        stack = getattr(self.local, "stack", None)
        if stack is None:
            stack = self.local.stack = []
        return stack

    def wrap(self, name, fn):
        def timed(*a, **k):
            stack = self.stack
            now = self.timer()
            if stack:
                top, since = stack[-1]
                self.spent[top] = self.spent.get(top, 0.0) + now - since
            stack.append((name, now))
            try:
                return fn(*a, **k)
            finally:
                end = self.timer()
                _, since = stack.pop()
                self.spent[name] = self.spent.get(name, 0.0) + end - since
                if stack:
                    stack[-1] = (stack[-1][0], end)

        timed.__wrapped__ = fn
        for attr in ("host_path", "device", "graphs", "stats"):
            if hasattr(fn, attr) and not callable(getattr(type(fn), attr, None)):
                try:
                    setattr(timed, attr, getattr(fn, attr))
                except AttributeError:
                    pass
        return timed


def instrument(agent, clock: Clock, stub: bool) -> None:
    import laya.agent
    import laya.common
    import torch

    from laya_aot.runtime import host_path

    hp = host_path.of(agent)
    if hp is not None:
        hp.prepare = clock.wrap("prepare", hp.prepare)
    laya.agent.collate_items = clock.wrap("collate", laya.agent.collate_items)
    laya.common.build_head = clock.wrap("build_head", laya.common.build_head)
    for name, attr in (("encode_state", "_encode_state"), ("infer", "_forward"), ("decode", "_decode_answers")):
        setattr(agent, attr, clock.wrap(name, getattr(agent, attr)))
    bo = agent.backend_object
    agent.model.forward = clock.wrap("backend", agent.model.forward)
    runner = bo.runner
    if stub:
        def fake(ids, att, mpos, mmask, qtype):
            return torch.zeros(mpos.shape, device=ids.device), torch.zeros((ids.shape[0], 4), device=ids.device)
        fake.device = runner.device
        bo.runner = clock.wrap("artifact", fake)
        bo.runner.device = runner.device
    else:
        bo.runner = clock.wrap("artifact", runner)
        bo.runner.device = runner.device


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--calls", default=",".join(c[0] for c in CALLS))
    ap.add_argument("--stub", action="store_true", help="a stand-in artifact of negligible cost")
    ap.add_argument("--stock-host", action="store_true", help="load with host_path=False")
    a = ap.parse_args()
    import laya_aot

    environment = harness.environment()
    agent = laya_aot.load(a.ckpt, bundle=a.bundle, device=a.device, strict=True, host_path=not a.stock_host)
    sync = harness.synchronizer(a.device)
    clock = Clock()
    instrument(agent, clock, a.stub)
    out = {}
    for name, n, words, qs in CALLS:
        if name not in a.calls.split(","):
            continue
        st = states(n, words)
        for _ in range(3):
            agent.predict_batch(st, qs)
        rows = []
        for _ in range(a.repeats):
            clock.spent.clear()
            sync()
            t = time.perf_counter()
            agent.predict_batch(st, qs)
            sync()
            total = time.perf_counter() - t
            row = {c: clock.spent.get(c, 0.0) * 1e6 for c in COMPONENTS}
            row["rest"] = total * 1e6 - sum(row.values())
            row["total"] = total * 1e6
            row["host"] = row["total"] - row["artifact"]
            rows.append(row)
        out[name] = {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0]}
    keys = list(COMPONENTS) + ["rest", "host", "total"]
    lines = ["Exclusive wall time per step, us per call, median of %d%s%s." % (
        a.repeats, "; the artifact stubbed" if a.stub else "", "; host_path=False" if a.stock_host else ""), "",
             "| component (us per call) | " + " | ".join(out) + " |", "|---|" + "---|" * len(out)]
    lines += ["| %s | %s |" % (k, " | ".join(str(out[c][k]) for c in out)) for k in keys]
    harness.write(a.out, "host_breakdown" + a.tag, {"environment": environment, "calls": out}, "\n".join(lines),
                  title="Where a call's host time goes")


if __name__ == "__main__":
    main()

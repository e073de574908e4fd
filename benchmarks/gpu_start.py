"""Process start to first answer, memory and realistic calls: laya eager against the default bundle.

    python3 benchmarks/gpu_start.py [--shape large-1024] [--starts 3] [--bytecode DIR] [--tag _a] [--device cpu]

Makes the checkpoint (laya's trainer format: fp16 weights on disk) and an AOTInductor bundle for the local GPU
under `--work` unless `--ckpt`/`--bundle` name existing ones. Then:
- **starts**: each a fresh `python3 -c` exactly as a user's process runs it (import, load, answer one
  question; nothing else is timed). The parent's clock at spawn to the child's at its first answer.
  Eager and bundle starts alternate; the bundle's first start has an empty laya-aot cache (the probe child
  runs), later ones reuse it. After the answer the child prints its `load_stats` (the timeline).
- **calls**: one process per path (laya eager; the bundle as `load` leaves it) answers three realistic typed
  calls (1 state x 1 choice question, 20 words; 8 states x 3 questions, 120 words; 32 states x 3 questions,
  400 words), median of 15 after 3 warm-ups, one synchronisation after each call (as a service times them),
  with decisions compared; memory resident after load and the peak of one 32-row x 1024-token forward.
`--device cpu` runs the same on a CPU machine (the CPU's calls; no memory figures).
Writes start_<shape><tag>.json and .md to --out.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import harness
from harness import CALLS, ONE, states

START = """
import time, laya_aot
agent = laya_aot.load({ckpt!r}, bundle={bundle!r}, device={device!r}{prefer})
agent.predict_batch(["I was charged twice for the March invoice"], {q!r})
import torch; torch.cuda.synchronize() if torch.cuda.is_available() else None; t = time.time()
print("FIRST", t, flush=True)
_b = agent.backend_object  # a fallback (no artifact fits) has `stats` and the reasons in `rejected`
print("STATS", __import__("json").dumps(dict(getattr(_b, "load_stats", None) or getattr(_b, "stats", dict()),
      backend=agent.backend), default=str), flush=True)
"""
START_EAGER = """
import time, laya
agent = laya.load({ckpt!r}, device={device!r})
agent.predict_batch(["I was charged twice for the March invoice"], {q!r})
import torch; torch.cuda.synchronize() if torch.cuda.is_available() else None; t = time.time()
print("FIRST", t, flush=True)
"""

# --stacks: a sampler thread in one more (untimed) bundle start, every 2 ms, each other thread's innermost frames
SAMPLER = """
import sys, threading, time, collections
_S, _T0 = collections.defaultdict(collections.Counter), time.perf_counter()
def _sample():
    me = threading.get_ident()
    while True:
        time.sleep(0.002)
        names = {t.ident: t.name for t in threading.enumerate()}
        at = int((time.perf_counter() - _T0) / 0.25)
        for ident, f in sys._current_frames().items():
            if ident == me:
                continue
            stack = []
            while f is not None and len(stack) < 5:
                where = f.f_code.co_filename.split("site-packages/")[-1]
                if where.startswith("<frozen"):  # the import machinery: one word for it
                    if not stack or stack[-1] != "(importing)":
                        stack.append("(importing)")
                else:
                    stack.append("%s:%d %s" % (where, f.f_lineno, f.f_code.co_name))
                f = f.f_back
            _S[names.get(ident, str(ident))][(at, " < ".join(stack))] += 1
threading.Thread(target=_sample, daemon=True, name="sampler").start()
"""
SAMPLER_REPORT = """
for _name, _c in _S.items():
    for _at in sorted({a for a, _ in _c}):
        for (_a, _st), _n in sorted(((k, n) for k, n in _c.items() if k[0] == _at), key=lambda kv: -kv[1])[:3]:
            print("STACK %s %.2f-%.2fs x%d %s" % (_name, _at / 4, (_at + 1) / 4, _n, _st), flush=True)
"""


def spawn_start(code: str, env: dict, timeout: float) -> dict:
    """One start in a fresh process: seconds from the spawn to its first answer, and its load_stats."""
    run = harness.python_child(code, env=env, timeout=timeout)
    out = {"rc": run.rc}
    if run.since_spawn() is not None:
        out["first_answer_s"] = run.since_spawn()
    if run.result("STATS") is not None:
        out["load_stats"] = run.result("STATS")
    if run.rc:
        out["stderr"] = run.stderr[-2000:]
    return out


def calls_child(path: str, ckpt: str, bundle: str, device: str = "cuda") -> None:
    """One process: load, memory after load, realistic calls, a 32x1024 forward's peak."""
    import torch

    if path == "eager":
        import laya

        agent = laya.load(ckpt, device=device)
    else:
        import laya_aot

        agent = laya_aot.load(ckpt, bundle=bundle, device=device, strict=True)
    cuda = device.startswith("cuda")
    harness.synchronizer(device)()
    resident = torch.cuda.memory_allocated() / 1e9 if cuda else None
    res = {"path": path, "backend": agent.backend, "resident_after_load_gb": resident, "calls": {}, "decisions": {}}
    if cuda:  # what the resident memory holds: the weights by dtype (the artifact's constants or laya's module)
        runner = getattr(getattr(agent, "backend_object", None), "runner", None)
        held = getattr(runner, "_consts", None) or dict(agent.model.named_parameters())
        by_dtype: dict = {}
        for t in held.values():
            if t.device.type == "cuda":
                by_dtype[str(t.dtype)] = by_dtype.get(str(t.dtype), 0) + t.numel() * t.element_size()
        res["weights_gb_by_dtype"] = {k: round(v / 1e9, 4) for k, v in by_dtype.items()}
        res["weights_numel"] = sum(t.numel() for t in held.values())
        res["memory_stats_after_load"] = {k: v for k, v in torch.cuda.memory_stats().items()
                                          if k in ("allocated_bytes.all.current", "reserved_bytes.all.current",
                                                   "active_bytes.all.current", "allocation.all.current")}
    for name, n, words, qs in CALLS:
        res["calls"][name], out = harness.predict_ms(agent, states(n, words), qs, repeats=15, device=device)
        res["decisions"][name] = [[harness.decision(a) for a in o["answers"].values()] for o in out]
    if not cuda:
        harness.emit(res)
        return
    args = harness.forward_args(32, 1024, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad(), torch.autocast("cuda", dtype=agent.dtype, enabled=agent.amp_enabled):
        agent.model(*args)
    torch.cuda.synchronize()
    res["peak_32x1024_gb"] = torch.cuda.max_memory_allocated() / 1e9
    bo = getattr(agent, "backend_object", None)
    res["stats"] = dict(getattr(bo, "stats", {}) or {}) if bo is not None else {}
    graphs = res["stats"].get("cuda_graphs")
    if isinstance(graphs, dict):  # the counters and any refusal's reason
        res["stats"]["cuda_graphs"] = {k: v for k, v in graphs.items() if k in ("captured", "replays", "refusals",
                                                                                 "evicted", "graphs", "refused")}
    harness.emit(res)


def run_calls(path: str, ckpt: Path, bundle: Path, env: dict, timeout: float, device: str) -> dict:
    run = harness.spawn([sys.executable, __file__, "--calls-child", path, "--ckpt", str(ckpt), "--bundle",
                         str(bundle), "--device", device], env=env, timeout=timeout)
    return run.result() or dict(path=path, **run.failure())


def main() -> None:
    ap = harness.parser(__doc__, work=True)
    ap.add_argument("--calls-child")
    ap.add_argument("--ckpt", type=Path, help="an existing checkpoint (default: made under --work)")
    ap.add_argument("--bundle", type=Path, help="an existing bundle of it (default: built under --work)")
    ap.add_argument("--shape", default="large-1024", help="the demo checkpoint's preset, when --ckpt is not given")
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--build-args", default="target=sm_90 stages.onnx=false stages.tilelang=false "
                                            "stages.inductor_cache=false")
    ap.add_argument("--second-bundle", metavar="DIR",
                    help="another built bundle (path bundle2) whose starts alternate with the others' in the same "
                         "run: two routes on one machine")
    ap.add_argument("--second-prefer", metavar="KIND[,KIND]", default=None,
                    help="the second bundle's starts ask for these artifact kinds (prefer=KIND), one path each "
                         "(bundle2:KIND): one bundle holding several routes, each timed")
    ap.add_argument("--no-eager", action="store_true", help="no laya eager starts (measured in other runs)")
    ap.add_argument("--device", default="cuda", help="cpu: the same on a CPU machine")
    ap.add_argument("--skip-calls", action="store_true")
    ap.add_argument("--profile", action="store_true", help="one more bundle start under cProfile, after the timed ones")
    ap.add_argument("--stacks", action="store_true",
                    help="one more bundle start with a stack sampler (every thread, 2 ms, quarter-second buckets), "
                         "after the timed ones: what each of the loader's threads waits on")
    ap.add_argument("--bytecode", metavar="DIR",
                    help="PYTHONPYCACHEPREFIX for every process (build, starts, calls), and one untimed start of each "
                         "path first (with a throwaway laya-aot cache): Python's bytecode cache as a pip install "
                         "leaves it, on a host whose site-packages have none and cannot be written")
    a = ap.parse_args()
    if a.calls_child:
        calls_child(a.calls_child, str(a.ckpt), str(a.bundle), a.device)
        return
    ckpt = a.ckpt or a.work / ("ckpt-%s" % a.shape)
    bundle = a.bundle or a.work / ("bundle-%s" % a.shape)
    name = "start_%s%s" % (a.shape, a.tag)
    res: dict = {"shape": a.shape, "starts": [], "calls": {}, "bytecode_beside_torch": _bytecode_beside_torch(),
                 "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE")}
    res["environment"] = harness.environment()
    if a.bytecode:  # a host image may set PYTHONDONTWRITEBYTECODE: no process there ever writes bytecode
        os.environ["PYTHONPYCACHEPREFIX"] = a.bytecode
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    t = time.time()
    if not (ckpt / "model.safetensors").exists():
        from laya_aot.demo import make_checkpoint

        make_checkpoint(ckpt, a.shape, seed=0)
    res["make_checkpoint_s"] = round(time.time() - t, 1)
    if not (bundle / "bundle.json").exists():
        t = time.time()
        # streamed, so a build cut short by a time limit still shows how far it got
        p = subprocess.run([sys.executable, "-m", "laya_aot.cli", "build", "checkpoint.path=%s" % ckpt,
                            "output_dir=%s" % bundle, *a.build_args.split()], text=True)
        res["build_s"] = round(time.time() - t, 1)
        res["build_rc"] = p.returncode
    cache = a.work / "laya-aot-cache"
    env = dict(os.environ, LAYA_AOT_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
    shutil.rmtree(cache, ignore_errors=True)
    q = ONE
    paths = [("eager", START_EAGER, bundle, "")] * (not a.no_eager) + [("bundle", START, bundle, "")]
    if a.second_bundle:
        for kind in (a.second_prefer or "").split(",") if a.second_prefer else [None]:
            paths.append(("bundle2:%s" % kind if kind else "bundle2", START, Path(a.second_bundle),
                          ", prefer=%r" % kind if kind else ""))
    if a.bytecode:  # untimed: writes the bytecode of everything a start imports; the timed starts' cache stays empty
        warm = dict(env, LAYA_AOT_CACHE_DIR=str(a.work / "warmup-cache"))
        res["warmup"] = {path: spawn_start(code.format(ckpt=str(ckpt), bundle=str(b), q=q, device=a.device,
                                                       prefer=pref), warm, 300).get("first_answer_s")
                         for path, code, b, pref in paths}
        print("warm-up", res["warmup"], flush=True)
    for i in range(a.starts):  # the paths alternate; each bundle's first start has an empty cache
        for path, code, b, pref in paths:
            r = spawn_start(code.format(ckpt=str(ckpt), bundle=str(b), q=q, device=a.device, prefer=pref), env, 300)
            r.update(path=path, n=i, first_on_machine=(path != "eager" and i == 0))
            res["starts"].append(r)
            print(path, i, r.get("first_answer_s"), r.get("rc"), (r.get("stderr") or "")[-500:], flush=True)
            harness.write(a.out, name, res, partial=True)  # a run cut short keeps every start it made
    if a.profile:  # not timed: where a later bundle start spends its time, by function
        code = ("import cProfile, pstats, io, time; pr = cProfile.Profile(); pr.enable()\n" +
                START.format(ckpt=str(ckpt), bundle=str(bundle), q=q, device=a.device, prefer="") +
                "pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats('cumulative')"
                ".print_stats(60); print(s.getvalue())")
        run = harness.spawn([sys.executable, "-X", "importtime", "-c", code], env=env)
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / ("profile_%s%s.txt" % (a.shape, a.tag))).write_text(run.stdout[-60000:])
        imports = sorted((ln for ln in run.stderr.splitlines() if ln.startswith("import time:") and "|" in ln
                          and ln.split("|")[1].strip().isdigit()), key=lambda ln: -int(ln.split("|")[1]))
        (a.out / ("importtime_%s%s.txt" % (a.shape, a.tag))).write_text("\n".join(imports[:200]))
    if a.stacks:  # not timed: the head start's threads beside laya's load, sampled
        run = harness.python_child(SAMPLER + START.format(ckpt=str(ckpt), bundle=str(bundle), q=q, device=a.device,
                                                          prefer="") + SAMPLER_REPORT, env=env, timeout=300)
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / ("stacks_%s%s.txt" % (a.shape, a.tag))).write_text(
            "\n".join(ln for ln in run.stdout.splitlines() if ln.startswith(("STACK ", "FIRST ", "STATS ")))
            + ("\n" + run.stderr[-3000:] if run.rc else ""))
    if not a.skip_calls:
        for path in ("eager", "bundle"):
            res["calls"][path] = run_calls(path, ckpt, bundle, env, 400, a.device)
            print(path, {k: v for k, v in res["calls"][path].items() if k != "decisions"}, flush=True)
        e, b = res["calls"]["eager"].get("decisions"), res["calls"]["bundle"].get("decisions")
        if e and b:
            res["decisions_equal"] = {k: "%d/%d" % (sum(x == y for re, rb in zip(e[k], b[k]) for x, y in zip(re, rb)),
                                                    sum(len(r) for r in e[k])) for k in e}
        for v in res["calls"].values():
            v.pop("decisions", None)
    harness.write(a.out, name, res, markdown(res), title="Starts and realistic calls, `%s`" % a.shape)


def _bytecode_beside_torch() -> bool:
    """Whether torch's own package has its bytecode cache beside it (what a pip install leaves)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    return bool(spec and spec.origin and os.path.exists(importlib.util.cache_from_source(spec.origin)))


def markdown(r: dict) -> str:
    lines = ["torch's bytecode cache beside it: %s; PYTHONDONTWRITEBYTECODE in the host's environment: %r; "
             "untimed warm-up starts (s): %s" % (r.get("bytecode_beside_torch"), r.get("PYTHONDONTWRITEBYTECODE"),
                                                 r.get("warmup", "none")), "",
             "| path | start | first answer (s) | agent_load_s | select_s | artifact_load_s | constants_s | "
             "weights prepared early (s) | waited for them (s) | waited for the probe (s) | smoke_check_s | probe |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in r["starts"]:
        ls = s.get("load_stats") or {}
        lines.append("| %s | %d%s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            s["path"], s["n"], " (first on machine)" if s.get("first_on_machine") else "", s.get("first_answer_s"),
            ls.get("agent_load_s", "-"), ls.get("select_s", "-"), ls.get("artifact_load_s", "-"),
            ls.get("constants_s", "-"), ls.get("weights_prepared_early_s", "-"),
            ls.get("weights_wait_after_laya_load_s", "-"), ls.get("probe_wait_after_laya_load_s", "-"),
            ls.get("smoke_check_s", "-"), ls.get("probe", "-")))
    if r.get("calls"):
        lines += ["", "| path | backend | resident after load GB | peak 32x1024 GB | " +
                  " | ".join("%s ms" % c[0] for c in CALLS) + " |", "|---" * (4 + len(CALLS)) + "|"]
        for p, v in r["calls"].items():
            lines.append("| %s | %s | %s | %s | %s |" % (
                p, v.get("backend"), _r(v.get("resident_after_load_gb")), _r(v.get("peak_32x1024_gb")),
                " | ".join(str(v.get("calls", {}).get(c[0], "-")) for c in CALLS)))
        lines += ["", "Decisions equal (bundle vs eager): %s" % r.get("decisions_equal")]
    return "\n".join(lines) + "\n"


def _r(x):
    return "-" if x is None else "%.2f" % x


if __name__ == "__main__":
    main()

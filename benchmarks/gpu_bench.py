"""GPU benchmark: laya eager / compile / fast=True against each bundle artifact, in fresh processes.

    python3 benchmarks/gpu_bench.py [--modes eager,bundle:aoti,...] [--shape large-1024] [--budget-s 560]

Makes the demo checkpoint `--shape` (ModernBERT-large dimensions, context 1024, by default) under `--work` unless
it exists, builds the bundle for the local GPU (sm_90) unless one built from it exists, then runs each mode in
its own fresh process and records: process start to first answer (the parent's wall clock at spawn to the
child's at its first answer), median latency of 20 forwards through the agent (CUDA events, 3 warm-ups,
4 markers) at 1x128, 8x256, 32x512, 32x1024, peak allocated GPU memory at 32x1024, TileLang/nvcc compile
attempts, and the largest difference of option/action probabilities from laya eager on the same inputs.

Every process gets its own empty Inductor, Triton, TileLang and laya-aot cache directories, so each
"first answer" is a cold start on this machine, except `compile-warm`, which reuses the cache that the
`compile` mode wrote (laya's persistent cache, warm). Bundle processes run with nvcc off PATH.
The build uses its own Inductor cache too, so no mode inherits the build's compiled code.

Modes: eager, fast, compile, compile-warm, bundle:<kind> (aoti, tilelang, compile, exported_program),
bundle (whatever the loader picks); `/nographs` after a bundle mode turns the runtime's CUDA graphs off;
`+restart` after any mode starts it again with the caches its first start wrote (probe verdicts).
Only gpu_<shape><tag>.json/.md and build_<shape><tag>.txt go to --out; outputs and logs stay under --work.
The JSON is rewritten after every mode, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import harness
from harness import FORWARD_SHAPES as SHAPES


def child(mode: str, ckpt: str, bundle: str, work: str) -> None:
    from jit_guard import jit_guard

    with jit_guard(forbid=False) as attempts:
        _child(mode, ckpt, bundle, work, attempts)


def _child(mode: str, ckpt: str, bundle: str, work: str, attempts) -> None:
    t0 = time.time()
    import torch

    t_torch = time.time()
    import laya

    t_import = time.time()
    base = mode.split("+")[0]
    if base == "eager":
        agent = laya.load(ckpt, device="cuda")
    elif base == "fast":
        agent = laya.load(ckpt, device="cuda", fast=True)
    elif base in ("compile", "compile-warm"):
        agent = laya.load(ckpt, device="cuda", compile=True)
    else:
        import laya_aot

        kind = base.split("/")[0].split(":", 1)[1] if ":" in base else None
        agent = laya_aot.load(ckpt, bundle=bundle, device="cuda", prefer=kind, strict=True,
                              cuda_graphs="/nographs" not in base)
    agent.predict_batch([harness.STATE], harness.ONE)
    torch.cuda.synchronize()
    t_first = time.time()
    print("FIRST %.6f" % t_first, flush=True)
    from laya_aot.kinds.inductor_cache import COMPILE_KEYS, compile_counters

    traced = compile_counters()  # this process's Dynamo traces and Inductor compiles up to its first answer
    res = {"mode": mode, "backend": agent.backend, "t_first": t_first, "t_imported": t_import,
           "import_torch_s": t_torch - t0, "import_laya_s": t_import - t_torch, "t_child_start": t0,
           "load_stats": getattr(getattr(agent, "backend_object", None), "load_stats", None),
           "latency_ms": {}, "first_call_s": {}, "compile_attempts_before_first_answer": sum(attempts.values()),
           "torch_compiles_at_first_answer": {k: traced[k] for k in COMPILE_KEYS}}
    max_len = int(agent.cfg.get("max_len", 512))
    outs = {}
    for rows, tokens in SHAPES:
        if tokens > max_len:
            continue
        batch = dict(zip(("input_ids", "attention_mask", "marker_pos", "marker_mask", "qtype"),
                         harness.forward_args(rows, tokens, vocab=3000, seed=rows * 7 + tokens)))
        key = "%dx%dx4" % (rows, tokens)
        with torch.no_grad():
            t0 = time.perf_counter()
            logits, act = agent._infer(batch)
            torch.cuda.synchronize()
            res["first_call_s"][key] = time.perf_counter() - t0
            outs[key] = (torch.softmax(logits.float(), -1).cpu(), torch.softmax(act.float(), -1).cpu())
            res["latency_ms"][key] = harness.cuda_event_ms(lambda batch=batch: agent._infer(batch))
            if rows == 32 and tokens == min(1024, max_len):
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                agent._infer(batch)
                torch.cuda.synchronize()
                res["peak_gb_32x1024x4"] = torch.cuda.max_memory_allocated() / 1e9
                res["peak_over_resident_gb_32x1024x4"] = (torch.cuda.max_memory_allocated() - base) / 1e9
        print("[%s] %s first %.3f s, median %.3f ms" % (mode, key, res["first_call_s"][key], res["latency_ms"][key]),
              flush=True)
    res["compile_attempts"] = dict(attempts)
    res["backend_stats"] = getattr(getattr(agent, "backend_object", None), "stats", None)
    # the artifact's runner: the compile route's format and whether it traced or compiled since its load
    res["runner_stats"] = getattr(getattr(getattr(agent, "backend_object", None), "runner", None), "stats", None)
    after = compile_counters()
    res["torch_compiles_at_end"] = {k: after[k] for k in COMPILE_KEYS}
    res["versions"] = {"torch": torch.__version__, "laya": laya.__version__, "device": torch.cuda.get_device_name()}
    torch.save(outs, os.path.join(work, "outputs_%s.pt" % _slug(mode)))
    harness.emit(res)


def _slug(mode: str) -> str:
    return mode.replace(":", "_").replace("/", "_").replace("+", "_")


def _env(work: Path, mode: str, cache_name: str, no_nvcc: bool) -> dict:
    """Fresh, private caches for one process (a cold start on this machine); nvcc hidden for bundles."""
    env = harness.private_caches(dict(os.environ, PYTHONUNBUFFERED="1"), work / "caches" / cache_name)
    return harness.without_nvcc(env) if no_nvcc else env


def spawn(mode: str, ckpt: Path, bundle: Path, work: Path, timeout: float) -> dict:
    # "<mode>+restart": a second start of <mode> on this machine, reusing the caches its first start wrote
    cache = "compile" if mode.startswith("compile-warm") else _slug(mode.split("+")[0])
    if mode.startswith("compile-warm") and not (work / "caches" / "compile" / "inductor").exists():
        return {"mode": mode, "error": "no cache from the `compile` mode to reuse"}
    env = _env(work, mode, cache, no_nvcc=mode.startswith("bundle"))
    run = harness.spawn([sys.executable, __file__, "--child", mode, "--ckpt", str(ckpt), "--bundle", str(bundle),
                         "--work", str(work)], env=env, timeout=timeout)
    (work / ("log_%s.txt" % _slug(mode))).write_text(run.stdout[-20000:] + "\n" + run.stderr[-20000:])
    r = run.result()
    if run.rc is None:
        return {"mode": mode, "error": "no result within %.0f s" % timeout, "start_to_first_s": run.since_spawn(),
                "log_tail": run.stdout[-1500:] + run.stderr[-1500:]}
    if run.rc != 0 or r is None:
        return {"mode": mode, "error": "exit %d: %s" % (run.rc, (run.stderr.strip().splitlines() or [""])[-1][:300]),
                "log_tail": run.stderr[-3000:]}
    r["start_to_first_s"] = r["t_first"] - run.started
    return r


def agreement(work: Path, mode: str) -> dict:
    import torch

    ref_path, got_path = work / "outputs_eager.pt", work / ("outputs_%s.pt" % _slug(mode))
    if not (ref_path.exists() and got_path.exists()):
        return {}
    ref, got = torch.load(ref_path), torch.load(got_path)
    return {k: {"option": float((ref[k][0] - got[k][0]).abs().max()),
                "action": float((ref[k][1] - got[k][1]).abs().max())}
            for k in ref if k in got}


def build(ckpt: Path, bundle: Path, work: Path, args: str, timeout: float, kernel_cache: str = "") -> dict:
    """`laya-aot build` for sm_90 in a child with its own caches; the manifest's facts, or why it failed.

    `kernel_cache`: a TileLang kernel cache to reuse (kernels cross-compiled earlier on a CPU machine);
    empty = the build's own empty cache, so every kernel compiles here."""
    t0 = time.time()
    cmd = [sys.executable, "-m", "laya_aot.cli", "build", "checkpoint.path=%s" % ckpt, "target=sm_90",
           "output_dir=%s" % bundle, *args.split()]
    env = _env(work, "build", "build", False)
    if kernel_cache:
        env["LAYA_AOT_KERNEL_CACHE"] = kernel_cache
    run = harness.spawn(cmd, env=env, timeout=timeout)
    rc = run.rc
    (work / "build_log.txt").write_text(run.stdout[-20000:] + "\n" + run.stderr[-30000:])
    out = {"command": "laya-aot build " + " ".join(shlex.quote(x) for x in cmd[4:]), "rc": rc,
           "seconds": round(time.time() - t0, 1)}
    if (bundle / "bundle.json").exists():
        m = json.loads((bundle / "bundle.json").read_text())
        out["stages"] = [{k: s.get(k) for k in ("name", "status", "seconds", "summary", "error", "format",
                                                 "precompile_failed") if k in s} for s in m["stages"]]
        out["artifacts"] = [{k: x.get(k) for k in ("name", "status", "variant", "size", "build_seconds", "latency_ms")}
                            | {"verify": {k: (x.get("verify") or {}).get(k) for k in
                                          ("passed", "reason", "max_abs_option_prob", "max_abs_action_prob",
                                           "argmax_agreement", "seconds")}}
                            for x in m["artifacts"]]
        out["tolerance"] = m.get("tolerance")
    return out



def _built_from(bundle: Path, ckpt: Path) -> bool:
    """Whether `bundle` reads as a bundle built from `ckpt` (checkpoint.mismatch, the loader's own test)."""
    from laya_aot import kinds
    from laya_aot.bundle_format import read_bundle
    from laya_aot.checkpoint import mismatch
    from laya_aot.manifest import BundleError

    try:
        return mismatch(read_bundle(bundle, kinds.NAMES), ckpt) is None
    except BundleError:
        return False


def main() -> None:
    ap = harness.parser(__doc__, work=True)
    ap.add_argument("--child")
    ap.add_argument("--ckpt", type=Path, help="the checkpoint (default: the demo --shape, made under --work)")
    ap.add_argument("--bundle", type=Path, help="its bundle (default: built under --work)")
    ap.add_argument("--shape", default="large-1024")
    ap.add_argument("--modes", default="eager,bundle:aoti,bundle:tilelang,bundle:compile,fast,compile,compile-warm")
    ap.add_argument("--build-args", default="stages.onnx=false")
    ap.add_argument("--timeout", type=float, default=240, help="per mode, seconds")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting modes when this is spent")
    ap.add_argument("--kernel-cache", default="", help="LAYA_AOT_KERNEL_CACHE for the build (cross-compiled kernels)")
    ap.add_argument("--no-build", action="store_true", help="never build (modes that need no bundle)")
    a = ap.parse_args()
    work = a.work
    work.mkdir(parents=True, exist_ok=True)
    ckpt = a.ckpt or work / ("ckpt-%s" % a.shape)
    bundle = a.bundle or work / ("bundle-%s" % a.shape)
    if a.child:
        child(a.child, str(ckpt), str(bundle), str(work))
        return
    shutil.rmtree(work / "caches", ignore_errors=True)  # every mode's first start is a cold one on this machine
    t_end = time.time() + a.budget_s
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu_%s%s" % (a.shape, a.tag)
    t0 = time.time()
    subprocess.check_call([sys.executable, "-m", "laya_aot.cli", "make-demo", str(ckpt), "--shape", a.shape])
    results = {"checkpoint": a.shape, "checkpoint_write_s": round(time.time() - t0, 1),
               "environment": harness.environment(), "build": {"reused": str(bundle)}, "modes": {}}
    if a.no_build:
        results["build"] = {"skipped": "--no-build", "bundle_present": (bundle / "bundle.json").exists()}
    elif not _built_from(bundle, ckpt):
        results["build"] = build(ckpt, bundle, work, a.build_args, max(60, t_end - time.time()), a.kernel_cache)
        shutil.copyfile(work / "build_log.txt", out / ("build_%s%s.txt" % (a.shape, a.tag)))
    harness.write(out, name, results, partial=True)
    print("build", json.dumps(results["build"], indent=1), flush=True)
    for mode in [m for m in a.modes.split(",") if m and m != "none"]:
        left = t_end - time.time()
        if left < 30:
            results["modes"][mode] = {"mode": mode, "error": "not run: the run's time budget was spent"}
            continue
        r = spawn(mode, ckpt, bundle, work, min(a.timeout, left))
        r["agreement_with_eager"] = agreement(work, mode) if mode != "eager" else {}
        results["modes"][mode] = r
        harness.write(out, name, results, partial=True)  # a run cut short keeps what it measured
        print(mode, json.dumps({k: r.get(k) for k in ("backend", "start_to_first_s", "latency_ms", "error",
                                                       "compile_attempts", "peak_gb_32x1024x4")}), flush=True)
    harness.write(out, name, results, markdown(results), title="Modes on one GPU, checkpoint `%s`" % a.shape)


def markdown(r: dict) -> str:
    keys = ["%dx%dx4" % s for s in SHAPES]
    lines = ["| mode | backend | start -> first answer | " + " | ".join(keys) + " (ms) | peak GB @32x1024 "
             "| compiles (TileLang/nvcc) | torch traces+compiles at first answer | max dp vs eager |",
             "|---|---|---|" + "---|" * len(keys) + "---|---|---|---|"]
    for mode, m in r["modes"].items():
        lat = m.get("latency_ms") or {}
        agree = m.get("agreement_with_eager") or {}
        worst = max((max(v.values()) for v in agree.values()), default=None)
        first = m.get("start_to_first_s")
        compiles = m.get("compile_attempts")
        traced = m.get("torch_compiles_at_first_answer")
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s |" % (
            mode, m.get("backend", "-"),
            ("%.1f s" % first if first else "-") + (" (%s)" % m["error"] if m.get("error") else ""),
            " | ".join("%.2f" % lat[k] if k in lat else "-" for k in keys),
            "%.2f" % m["peak_gb_32x1024x4"] if "peak_gb_32x1024x4" in m else "-",
            sum(compiles.values()) if compiles is not None else "-",
            sum(traced.values()) if traced is not None else "-",
            "%.3g" % worst if worst is not None else "-"))
    lines += ["", *start_ratios(r)]
    return "\n".join(lines) + "\n"


def start_ratios(r: dict) -> list:
    """The compile route's start against the AOTInductor route's (goal: at most 1.5x, no compile)."""
    out = []
    for suffix in ("", "+restart"):
        c, a = (r["modes"].get("bundle:%s%s" % (k, suffix)) or {} for k in ("compile", "aoti"))
        if c.get("start_to_first_s") and a.get("start_to_first_s"):
            fmt = (c.get("runner_stats") or {}).get("format", "?")
            out.append("- bundle:compile%s (%s) start %.1f s / bundle:aoti%s %.1f s = %.2fx; torch traces+compiles in "
                       "the compile route's process: %s" % (
                           suffix, fmt, c["start_to_first_s"], suffix, a["start_to_first_s"],
                           c["start_to_first_s"] / a["start_to_first_s"], c.get("torch_compiles_at_first_answer")))
    return out


if __name__ == "__main__":
    main()

"""CPU benchmark: process start -> first answer, and per-call latency, bundle vs laya eager vs laya compile.

Every start-up figure is a whole fresh Python process (median of --runs): the parent records the wall
clock just before it spawns the child and the child reports the wall clock at its first answer, so
interpreter start, imports, loading and the first request all count. Per-call latency is the model forward
through the agent at 1x128x4 and 8x256x4 (median of 20 after 3 warm-ups), for the bundle as loaded and for
each runtime artifact kind forced with `prefer=`.

    python benchmarks/cpu_startup.py --shape tiny --runs 5 --modes bundle,eager
    python benchmarks/cpu_startup.py --shape base-512 --runs 5 --modes bundle,eager

The demo checkpoint (`--shape`) and its bundle are made under `--work` unless they exist. Without `--modes`,
laya `compile=True` runs as well, each start with a cold Inductor cache (minutes per start).
Writes cpu_<shape><tag>.json and .md to --out.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import harness

QUESTIONS = {
    "team": {"type": "choice", "instructions": "Which team should handle this?",
             "criteria": {"billing": "payments", "technical": "errors", "account": "login"}},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high", "critical"]},
    "angry": {"type": "noul", "instructions": "The customer is angry."},
}
STATE = "The service has been down since this morning and I was charged twice for the March invoice."


def child(mode: str, ckpt: str, bundle: str, latency: bool) -> None:
    """One fresh process: load, answer once, optionally time per-call latency, print JSON."""
    import laya  # noqa: F401  (part of what a service imports)
    import torch

    t_import = time.time()
    if mode.startswith("bundle"):
        import laya_aot

        prefer = mode.split(":", 1)[1] if ":" in mode else None
        agent = laya_aot.load(ckpt, bundle=bundle, device="cpu", prefer=prefer, strict=bool(prefer))
    elif mode == "eager":
        agent = laya.load(ckpt, device="cpu")
    else:
        agent = laya.load(ckpt, device="cpu", compile=True)
    t_loaded = time.time()
    res = agent.predict_batch([STATE], QUESTIONS)
    t_first = time.time()
    out = {"mode": mode, "backend": agent.backend, "t_import": t_import, "t_loaded": t_loaded,
           "artifact": getattr(getattr(agent.backend_object, "artifact", None), "name", None),
           "t_first": t_first, "answer": res[0]["answers"]["team"]["choice"],
           "load_stats": getattr(agent.backend_object, "load_stats", None)}
    if latency:
        out["latency_ms"] = per_call(agent, torch)
    harness.emit(out)


def per_call(agent, torch) -> dict:
    """Median ms of agent.model(...) at rows x tokens x 4 markers after 3 warm-ups (20 calls)."""
    max_len = int(agent.cfg.get("max_len", 512))
    out = {}
    for rows, tokens in ((1, 128), (8, 256)):
        tokens = min(tokens, max_len)
        batch = harness.forward_args(rows, tokens, vocab=200)

        def forward(batch=batch):
            with torch.no_grad():
                agent.model(*batch)

        out["%dx%dx4" % (rows, tokens)] = harness.median_ms(forward)
    return out


def spawn(mode: str, ckpt, bundle, env: dict, latency: bool = False) -> dict:
    run = harness.spawn([sys.executable, __file__, "--child", mode, "--ckpt", str(ckpt), "--bundle", str(bundle)]
                        + (["--latency"] if latency else []), env=env)
    r = run.result()
    if run.rc != 0 or r is None:
        raise RuntimeError("%s child failed (%s): %s" % (mode, run.rc, run.stderr[-2000:]))
    r.update(start_to_first_s=r["t_first"] - run.started, start_to_loaded_s=r["t_loaded"] - run.started)
    return r


def main() -> None:
    ap = harness.parser(__doc__, work=True)
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--modes", default="bundle,eager,compile")
    ap.add_argument("--child")
    ap.add_argument("--ckpt")
    ap.add_argument("--bundle")
    ap.add_argument("--latency", action="store_true")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.ckpt, a.bundle, a.latency)
        return
    from laya_aot import kinds
    from laya_aot.bundle_format import read_bundle
    from laya_aot.checkpoint import mismatch
    from laya_aot.demo import make_checkpoint
    from laya_aot.manifest import BundleError

    ckpt = make_checkpoint(a.work / ("ckpt-%s" % a.shape), a.shape)
    bundle = a.work / ("bundle-%s" % a.shape)
    build_s = None
    try:
        stale = mismatch(read_bundle(bundle, kinds.NAMES), ckpt)
    except BundleError as e:
        stale = str(e)
    if stale:
        t0 = time.time()
        subprocess.check_call([sys.executable, "-m", "laya_aot.cli", "build", "checkpoint.path=%s" % ckpt,
                               "output_dir=%s" % bundle])
        build_s = time.time() - t0
    cache = tempfile.mkdtemp(prefix="laya-aot-bench-cache-")
    env = dict(os.environ, LAYA_AOT_CACHE_DIR=cache, PYTHONWARNINGS="ignore")
    results: dict = {"shape": a.shape, "runs": a.runs, "build_s": build_s, "environment": harness.environment(),
                     "modes": {}}
    modes = a.modes.split(",")
    if "bundle" in modes:
        cold = spawn("bundle", ckpt, bundle, env)        # empty verdict cache: the probe runs
        results["bundle_cold_probe"] = {"start_to_first_s": cold["start_to_first_s"], "load_stats": cold["load_stats"]}
    for mode in modes:
        runs = []
        for _ in range(a.runs):
            run_env = dict(env)
            if mode == "compile":  # cold Inductor cache every time: what a fresh container sees
                run_env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
            runs.append(spawn(mode, ckpt, bundle, run_env))
        firsts = [r["start_to_first_s"] for r in runs]
        results["modes"][mode] = {"backend": runs[0]["backend"], "artifact": runs[0].get("artifact"),
                                  "start_to_first_s": firsts,
                                  "median_start_to_first_s": statistics.median(firsts),
                                  "load_stats": runs[-1]["load_stats"]}
    for mode in ("bundle", "eager"):
        if mode in modes:
            results["modes"][mode]["latency_ms"] = spawn(mode, ckpt, bundle, env, latency=True)["latency_ms"]
    # per-call latency of each runtime artifact kind, forced with prefer=
    results["latency_by_artifact_ms"] = {}
    for kind in ("aoti", "onnx"):
        r = spawn("bundle:" + kind, ckpt, bundle, env, latency=True)
        results["latency_by_artifact_ms"][kind] = {
            "artifact": r.get("artifact"), "latency_ms": r["latency_ms"]}
    if "bundle" in modes and "eager" in modes:
        eager = results["modes"]["eager"]["latency_ms"]
        results["latency_ratio_bundle_over_eager"] = {
            k: results["modes"]["bundle"]["latency_ms"][k] / eager[k] for k in eager}
        results["latency_ratio_by_artifact_over_eager"] = {
            kind: {k: v["latency_ms"][k] / eager[k] for k in eager}
            for kind, v in results["latency_by_artifact_ms"].items()}
    harness.write(a.out, "cpu_%s%s" % (a.shape, a.tag), results, markdown(results),
                  title="CPU start-up and latency, shape `%s`" % a.shape)


def markdown(r: dict) -> str:
    lines = ["Start-up = whole fresh process, median of %d." % r["runs"], ""]
    if r.get("build_s"):
        lines.append("Bundle build: %.1f s." % r["build_s"])
    if "bundle_cold_probe" in r:
        lines.append("Bundle, first start on this machine (probe runs): %.2f s; load stats %s." % (
            r["bundle_cold_probe"]["start_to_first_s"], r["bundle_cold_probe"]["load_stats"]))
    lines += ["", "| mode | backend | start -> first answer (median) | runs | 1x128x4 ms | 8x256x4 ms |",
              "|---|---|---|---|---|---|"]
    for mode, m in r["modes"].items():
        lat = m.get("latency_ms") or {}
        cols = [lat.get(k) for k in sorted(lat)] or [None, None]
        backend = m["backend"] + (" (%s)" % m["artifact"] if m.get("artifact") else "")
        lines.append("| %s | %s | %.2f s | %s | %s | %s |" % (
            mode, backend, m["median_start_to_first_s"], ", ".join("%.2f" % x for x in m["start_to_first_s"]),
            *["%.2f" % c if c is not None else "-" for c in (cols + [None, None])[:2]]))
    for kind, v in (r.get("latency_by_artifact_ms") or {}).items():
        ratio = (r.get("latency_ratio_by_artifact_over_eager") or {}).get(kind, {})
        lines.append("")
        lines.append("Artifact `%s` forced with prefer=%r: %s" % (v["artifact"], kind, ", ".join(
            "%s %.2f ms (%.2fx eager)" % (k, ms, ratio.get(k, float("nan"))) for k, ms in v["latency_ms"].items())))
    if "latency_ratio_bundle_over_eager" in r:
        lines += ["", "Per-call latency ratio bundle/eager: " + ", ".join(
            "%s %.2f" % kv for kv in r["latency_ratio_bundle_over_eager"].items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

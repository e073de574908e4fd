"""GPU check of the precision policy: matrix checkpoints served in laya's own dtype.

    python3 benchmarks/gpu_matrix.py [--names a,b,...] [--kernel-cache DIR] [--parallel 4] [--serve-parallel 1]

For each matrix checkpoint (laya_aot.demo.MATRIX; default: four, with amp_dtype absent, fp16 and bf16) it
builds a bundle for this GPU with laya's policy (no dtype given: the build works it out), then loads each of
the AOTInductor, TileLang and compile artifacts in a fresh process (empty Inductor/Triton/TileLang caches,
nvcc off PATH) with `prefer=KIND, strict=True`, and in the same process laya's eager agent (which serves
in the same dtype). It records: the dtype laya serves in, the artifact's verify figures and laya eager-in-
dtype's from the manifest, compile attempts (TileLang/nvcc entry points) and Inductor compiles (Dynamo
graphs, FX-graph misses) after loading, and, over 60 typed questions x 3 states, how many decisions equal
laya eager's and the largest probability difference; for each differing decision, laya eager's decision
for that question asked on its own (laya's 16-bit GPU arithmetic changes with the batch). The near-tie
guard (runtime/backend.py) is on as `load` leaves it ("call": whole calls with a near-tie recomputed, laya's
outputs for the same batch); the same agent then answers with near_ties="rows" (only those rows) and "off"
(the artifact's own decisions), and each mode and laya eager are timed (predict_batch of the 3 states x 60
questions, median of 5, twice each), as are single-question calls. For timings, serve one process at a time
(`--serve-parallel 1`). Writes gpu_matrix<tag>.json/.md and the build logs to --out.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import harness
from harness import decision as _decision
from harness import margin as _margin

DEFAULT = ("hd32-absent-decisive", "hd16-1head-ctx128", "hd16-16heads-fp16", "hd16-8heads-fp16-ctx384")
KINDS = ("aoti", "tilelang", "compile")


def _probs(a):
    out = dict(a.get("probabilities") or {})
    if a["type"] == "noul":
        out["noul"] = a["noul"]
    out["act"] = a["action"]["act_probability"]
    return out


def child(ckpt: str, bundle: str, kind: str) -> None:
    import numpy as np
    from jit_guard import jit_guard

    with jit_guard(forbid=False) as attempts:
        import laya
        import torch
        from torch._dynamo.utils import counters

        import laya_aot
        from laya_aot.demo import question_suite, state_text
        from laya_aot.laya_internals import serving_dtype

        t0 = time.perf_counter()
        agent = laya_aot.load(ckpt, bundle=bundle, device="cuda", prefer=kind, strict=True)
        qs = question_suite()
        rng = np.random.default_rng(11)
        states = [state_text(rng, n) for n in (5, 40, 160)]
        got = agent.predict_batch(states, qs)
        got = agent.predict_batch(states, qs)  # a second call: CUDA graphs replay from here on
        torch.cuda.synchronize()
        load_and_answer_s = time.perf_counter() - t0
        compiles = {"tilelang_nvcc_attempts": sum(attempts.values()),
                    "dynamo_graphs": int(counters["stats"]["unique_graphs"]),
                    "fxgraph_cache_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
                    "fxgraph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"])}
        eager = laya.load(ckpt, device="cuda")
        ref = eager.predict_batch(states, qs)
        # the fp32 forward on this GPU: laya's agent with autocast off (its weights are fp32 in memory)
        fp32 = laya.load(ckpt, device="cuda")
        fp32.amp_enabled = False
        ref32 = fp32.predict_batch(states, qs)
        same = total = art_eq_fp32 = eager_eq_fp32 = 0
        worst = 0.0
        differing = []
        for i, (g, r, f) in enumerate(zip(got, ref, ref32)):
            for qid in r["answers"]:
                a, b, c = g["answers"][qid], r["answers"][qid], f["answers"][qid]
                total += 1
                same += _decision(a) == _decision(b)
                art_eq_fp32 += _decision(a) == _decision(c)
                eager_eq_fp32 += _decision(b) == _decision(c)
                if _decision(a) != _decision(b):
                    differing.append({"question": qid, "type": b["type"], "eager_margin": round(_margin(b), 5),
                                      "fp32_margin": round(_margin(c), 5),
                                      "artifact_equals_fp32": _decision(a) == _decision(c),
                                      "eager_equals_fp32": _decision(b) == _decision(c),
                                      # laya eager asked this question on its own: does laya agree with itself?
                                      "eager_alone_equals_artifact": _decision(
                                          eager.predict_batch([states[i]], {qid: qs[qid]})[0]["answers"][qid])
                                      == _decision(a)})
                pa, pb = _probs(a), _probs(b)
                worst = max([worst] + [abs(pa[k] - pb[k]) for k in pb])
        bo = agent.backend_object
        stats_on = {k: val for k, val in bo.stats.items() if k != "cuda_graphs"}
        # the same agent in the other near-tie modes: whole calls recomputed (laya's own outputs for the batch),
        # only the near-tie rows, or the guard off (what the artifact decides on its own); then what each costs
        first_mode = bo.near_ties  # what `load` leaves, which answered above
        same_mode = {first_mode: same}
        for mode in ("call", "rows", "off"):
            if mode == first_mode:
                continue
            bo.near_ties = mode
            got_mode = agent.predict_batch(states, qs)
            same_mode[mode] = sum(_decision(g["answers"][q]) == _decision(r["answers"][q])
                                  for g, r in zip(got_mode, ref) for q in r["answers"])
        def median_ms(who) -> float:
            return round(harness.predict_ms(who, states, qs, repeats=5, warmup=0, device="cuda")[0], 2)

        predict_ms = {}
        for mode in ("rows", "call", "off") * 2:
            bo.near_ties = mode
            predict_ms.setdefault("near_ties_" + mode, []).append(median_ms(agent))
        predict_ms["laya_eager"] = [median_ms(eager)]
        # single-question calls, as a service gets them: every (state, question) pair once per mode, in order,
        # after an untimed pass of every mode; the mean includes the calls whose near-tie laya recomputed
        pairs = [(s_, q) for s_ in states for q in qs]
        single = {}
        for mode in ("eager", "rows", "call", "off") * 2:  # the first pass warms every shape up (graph captures)
            who = eager if mode == "eager" else agent
            if mode != "eager":
                bo.near_ties = mode
                bo.reset_stats()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            dec = [_decision(who.predict_batch([s_], {q: qs[q]})[0]["answers"][q]) for s_, q in pairs]
            torch.cuda.synchronize()
            single[mode] = {"mean_ms": round((time.perf_counter() - t1) * 1e3 / len(pairs), 3), "decisions": dec,
                            "near_tie_calls": bo.stats.get("near_tie_calls", 0) if mode != "eager" else None}
        single_calls = {m: {"mean_ms": x["mean_ms"], "near_tie_calls": x["near_tie_calls"],
                            "decisions_equal_eager": sum(a_ == b_ for a_, b_ in zip(x["decisions"],
                                                                                  single["eager"]["decisions"]))}
                        for m, x in single.items()}
        bo.near_ties = first_mode
        art = bo.artifact
        v = art.verify
        res = {"kind": kind, "backend": agent.backend, "artifact": art.name, "artifact_dtype": art.dtype,
               "agent_serves": serving_dtype(agent), "eager_serves": serving_dtype(eager),
               "load_and_first_answers_s": round(load_and_answer_s, 3), "compiles_after_load": compiles,
               "decisions_equal": same, "decisions": total,
               "decisions_equal_fp32": {"artifact": art_eq_fp32, "eager_in_dtype": eager_eq_fp32},
               "differing_decisions": differing, "max_prob_diff_vs_eager": worst,
               "verify": {"max_abs_option_prob": v.max_abs_option_prob, "max_abs_action_prob": v.max_abs_action_prob,
                          "argmax_agreement": v.argmax_agreement, "tolerance": v.tolerance, "rule": v.rule,
                          "eager_in_dtype": v.eager_in_dtype.__dict__ if v.eager_in_dtype else None,
                          "status": art.status},
               "tie_margin": bo.tie_margin, "stats_first_two_calls": stats_on,
               "near_ties_mode": first_mode, "decisions_equal_by_near_tie_mode": same_mode,
               "single_question_calls": single_calls,
               "predict_batch_ms_3_states_x_60_questions": predict_ms,
               "cuda_graphs": bo.stats.get("cuda_graphs"), "load_stats": bo.load_stats}
        harness.emit(res)


def _env(work, name: str, no_nvcc: bool, kernel_cache: str = None) -> dict:
    env = harness.private_caches(dict(os.environ, PYTHONUNBUFFERED="1"), work / "caches" / name)
    if kernel_cache:
        env["LAYA_AOT_KERNEL_CACHE"] = kernel_cache
    return harness.without_nvcc(env) if no_nvcc else env


def main() -> int:
    p = harness.parser(__doc__, work=True)
    p.add_argument("--names", default=",".join(DEFAULT))
    p.add_argument("--kernel-cache", default=None, help="a TileLang kernel cache cross-compiled elsewhere")
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--serve-parallel", type=int, default=None, help="serving processes at once (default: --parallel;"
                   " 1 for timings without other processes on the GPU)")
    p.add_argument("--max-rows", type=int, default=16, help="export.max_rows (fewer TileLang row buckets)")
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--child", nargs=3, metavar=("CKPT", "BUNDLE", "KIND"))
    a = p.parse_args()
    if a.child:
        child(*a.child)
        return 0
    t_start = time.time()
    out, work = a.out, a.work
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "caches", ignore_errors=True)  # every serving process starts as on a new machine
    work.mkdir(parents=True, exist_ok=True)
    names = a.names.split(",")
    from laya_aot.demo import make_checkpoint

    ckpts = {n: make_checkpoint(work / "ckpt" / n, n, seed=7) for n in names}
    report = {"environment": harness.environment(), "checkpoints": {}}
    jobs = max(1, (os.cpu_count() or 4) // max(1, min(a.parallel, len(names))))

    def build(n):
        bundle = work / "bundle" / n
        cmd = [sys.executable, "-m", "laya_aot.cli", "build", "checkpoint.path=%s" % ckpts[n], "target=sm_90",
               "output_dir=%s" % bundle, "stages.onnx=false", "jobs=%d" % jobs, "export.max_rows=%d" % a.max_rows]
        t0 = time.time()
        try:
            # what the budget leaves, minus a minute for the serving processes
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30, a.budget_s - (time.time() - t_start)
                                                                                 - 60),
                               env=_env(work, "build-" + n, False, a.kernel_cache))
            rc, log = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, log = -1, "TIMEOUT\n%s\n%s" % (e.stdout, e.stderr)
        log = "\n".join(x for x in log.splitlines() if "kernel/s" not in x and "s/kernel" not in x)
        with open(out / "build_logs.txt", "a") as f:  # kept as it goes: a run cut short still shows its builds
            f.write("===== %s (rc %d, %.1f s)\n$ %s\n%s\n" % (n, rc, time.time() - t0, " ".join(cmd), log[-8000:]))
        return n, rc, round(time.time() - t0, 1)

    with ThreadPoolExecutor(a.parallel) as pool:
        for n, rc, secs in pool.map(build, names):
            m = json.loads((work / "bundle" / n / "bundle.json").read_text()) if rc == 0 else None
            report["checkpoints"][n] = {"build_rc": rc, "build_s": secs,
                                        "amp_dtype": m and m["checkpoint"]["amp_dtype"],
                                        "artifacts": {x["name"]: {"kind": x["kind"], "dtype": x.get("dtype"),
                                                                  "status": x["status"],
                                                                  "verify": x.get("verify") and {
                                                                      k: x["verify"].get(k) for k in (
                                                                          "max_abs_option_prob", "max_abs_action_prob",
                                                                          "argmax_agreement", "tolerance", "reason",
                                                                          "eager_in_dtype")}}
                                                      for x in (m["artifacts"] if m else [])},
                                        "serving": {}}
            print("built %s: rc %d in %.1f s" % (n, rc, secs), flush=True)

    def serve(job):
        n, kind = job
        if time.time() - t_start > a.budget_s - 30:
            return n, kind, {"skipped": "out of time budget"}
        run = harness.spawn([sys.executable, __file__, "--child", str(ckpts[n]), str(work / "bundle" / n), kind],
                            env=_env(work, "serve-%s-%s" % (n, kind), True),
                            timeout=max(30, a.budget_s - (time.time() - t_start)))
        if run.rc is None:
            return n, kind, {"failed": "did not finish within the time budget"}
        found = run.result()
        if found is not None:
            return n, kind, found
        return n, kind, {"failed": (run.stderr.strip().splitlines() or ["no output"])[-1][:500], "rc": run.rc}

    def save(final: bool = False):
        report["wall_s"] = round(time.time() - t_start, 1)
        harness.write(out, "gpu_matrix" + a.tag, report, markdown(report) if final else "", partial=not final,
                      title="Matrix checkpoints served in laya's own dtype")

    save()
    todo = [(n, k) for n in names if report["checkpoints"][n]["build_rc"] == 0 for k in KINDS]
    with ThreadPoolExecutor(a.serve_parallel or a.parallel) as pool:
        for n, kind, res in pool.map(serve, todo):
            report["checkpoints"][n]["serving"][kind] = res
            save()
            print("served %s %s: %s" % (n, kind, {k: res.get(k) for k in ("backend", "decisions_equal", "decisions",
                                                                         "failed", "compiles_after_load")}), flush=True)
    save(final=True)
    return 0


def markdown(r: dict) -> str:
    lines = ["| checkpoint | amp_dtype | kind | laya serves | artifact dtype | verify max dp opt/act (allowed) | "
             "laya eager-in-dtype dp opt/act | decisions = eager (as loaded) | = fp32: artifact / eager | "
             "eager margin where differ | max prob diff | tie margin | near-tie rows (2 calls) | "
             "decisions = eager: call / rows / off | predict_batch ms: rows / call / off / laya eager | "
             "TileLang/nvcc | Dynamo graphs / FX misses | graph replays |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, c in r["checkpoints"].items():
        for kind, s in c["serving"].items():
            if "failed" in s or "skipped" in s:
                lines.append("| %s | %s | %s | %s |" % (n, c["amp_dtype"], kind, s.get("failed") or s.get("skipped")))
                continue
            v, e, comp = s["verify"], s["verify"]["eager_in_dtype"] or {}, s["compiles_after_load"]
            g = s.get("cuda_graphs") or {}
            st, ms = s.get("stats_first_two_calls", {}), s.get("predict_batch_ms_3_states_x_60_questions", {})
            by_mode = s.get("decisions_equal_by_near_tie_mode", {})
            lines.append(("| %s | %s | %s | %s | %s | %.3g / %.3g (%.3g) | %s | %d/%d | %s / %s | %s | %.3g | %s | %s "
                          "| %s | %s | %d | %d / %d | %s |") % (
                n, c["amp_dtype"], kind, s["agent_serves"], s["artifact_dtype"], v["max_abs_option_prob"],
                v["max_abs_action_prob"], v["tolerance"],
                "%.3g / %.3g" % (e["max_abs_option_prob"], e["max_abs_action_prob"]) if e else "-",
                s["decisions_equal"], s["decisions"], s["decisions_equal_fp32"]["artifact"],
                s["decisions_equal_fp32"]["eager_in_dtype"],
                ", ".join("%.3g%s" % (d["eager_margin"], " (laya alone: %s)" % (
                    "same as artifact" if d["eager_alone_equals_artifact"] else "same as laya")
                    if "eager_alone_equals_artifact" in d else "") for d in s["differing_decisions"]) or "-",
                s["max_prob_diff_vs_eager"], "%.3g" % s["tie_margin"] if s.get("tie_margin") is not None else "-",
                "%d of %d" % (st.get("near_tie_rows", 0), 2 * s["decisions"]) if st else "-",
                " / ".join("%d/%d" % (by_mode[m], s["decisions"]) if m in by_mode else "-"
                           for m in ("call", "rows", "off")),
                " / ".join("%.1f" % min(ms[k]) if k in ms else "-" for k in (
                    "near_ties_rows", "near_ties_call", "near_ties_off", "laya_eager")) if ms else "-",
                comp["tilelang_nvcc_attempts"],
                comp["dynamo_graphs"], comp["fxgraph_cache_miss"], g.get("replays", "-")))
    lines += ["", "Single-question calls (each of the 180 (state, question) pairs once, in order, after a warm-up pass "
              "of every mode): mean ms per call, "
              "calls with a near-tie, decisions equal to laya eager asked the same single question", "",
              "| checkpoint | kind | laya eager ms | rows: ms, near-tie calls, = eager | call: same "
              "| off: ms, = eager |",
              "|---|---|---|---|---|---|"]
    for n, c in r["checkpoints"].items():
        for kind, s in c["serving"].items():
            sq = s.get("single_question_calls")
            if not sq:
                continue
            lines.append("| %s | %s | %.2f | %.2f, %d, %d/180 | %.2f, %d, %d/180 | %.2f, %d/180 |" % (
                n, kind, sq["eager"]["mean_ms"], sq["rows"]["mean_ms"], sq["rows"]["near_tie_calls"],
                sq["rows"]["decisions_equal_eager"], sq["call"]["mean_ms"], sq["call"]["near_tie_calls"],
                sq["call"]["decisions_equal_eager"], sq["off"]["mean_ms"], sq["off"]["decisions_equal_eager"]))
    lines += ["", "Builds: " + ", ".join("%s %s in %.0f s" % (n, "ok" if c["build_rc"] == 0 else "FAILED", c["build_s"])
                                       for n, c in r["checkpoints"].items()), "Wall: %.0f s" % r["wall_s"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

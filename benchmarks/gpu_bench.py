"""GPU benchmark (issue 5): laya eager / compile / fast=True against each bundle artifact, in fresh processes.

On the GPU host, after the .device-site unpack line:

    python3 benchmarks/gpu_bench.py --out $OUT [--modes eager,bundle:compile,fast,compile] [--shape large-1024]

Makes the ModernBERT-large-sized random checkpoint (context 1024) unless it exists, builds the bundle for
the local GPU unless it exists, then runs each mode in its own fresh process and records: process start
to first answer (the parent's wall clock at spawn to the child's at its first answer), median latency of
20 forwards through the agent (CUDA events, 3 warm-ups, 4 markers) at 1x128, 8x256, 32x512, 32x1024,
peak allocated GPU memory at 32x1024, and the largest difference of option/action probabilities from
laya eager on the same inputs. Writes gpu_<shape>.json and .md under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = ((1, 128), (8, 256), (32, 512), (32, 1024))
QUESTIONS = {"team": {"type": "choice", "instructions": "Which team should handle this?",
                      "criteria": {"billing": "payments", "technical": "errors", "account": "login"}}}
STATE = "The service has been down since this morning and I was charged twice for the March invoice."


def child(mode: str, ckpt: str, bundle: str, out: str) -> None:
    import laya
    import torch

    if mode == "eager":
        agent = laya.load(ckpt, device="cuda")
    elif mode == "fast":
        agent = laya.load(ckpt, device="cuda", fast=True)
    elif mode == "compile":
        agent = laya.load(ckpt, device="cuda", compile=True)
    else:
        import laya_aot

        agent = laya_aot.load(ckpt, bundle=bundle, device="cuda", prefer=mode.split(":", 1)[1], strict=True)
    agent.predict_batch([STATE], QUESTIONS)
    torch.cuda.synchronize()
    t_first = time.time()
    print("FIRST %.6f" % t_first, flush=True)
    res = {"mode": mode, "backend": agent.backend, "t_first": t_first,
           "load_stats": getattr(agent.backend_object, "load_stats", None), "latency_ms": {}, "first_call_s": {}}
    max_len = int(agent.cfg.get("max_len", 512))
    outs = {}
    for rows, tokens in SHAPES:
        if tokens > max_len:
            continue
        g = torch.Generator().manual_seed(rows * 7 + tokens)
        ids = torch.randint(5, 3000, (rows, tokens), generator=g)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                 "marker_pos": torch.tensor([[3, 9, 15, 21]] * rows), "marker_mask": torch.ones((rows, 4), dtype=torch.bool),
                 "qtype": torch.zeros(rows, dtype=torch.long)}
        key = "%dx%dx4" % (rows, tokens)
        with torch.no_grad():
            t0 = time.perf_counter()
            logits, act = agent._infer(batch)
            torch.cuda.synchronize()
            res["first_call_s"][key] = time.perf_counter() - t0
            outs[key] = (torch.softmax(logits.float(), -1).cpu(), torch.softmax(act.float(), -1).cpu())
            for _ in range(3):
                agent._infer(batch)
            times = []
            for _ in range(20):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                agent._infer(batch)
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e))
            res["latency_ms"][key] = statistics.median(times)
            if key == "32x1024x4" or (tokens == max_len and rows == 32):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                agent._infer(batch)
                torch.cuda.synchronize()
                res["peak_gb_%s" % key] = torch.cuda.max_memory_allocated() / 1e9
    torch.save(outs, os.path.join(out, "outputs_%s.pt" % mode.replace(":", "_")))
    print("RESULT " + json.dumps(res), flush=True)


def spawn(mode: str, ckpt: Path, bundle: Path, out: Path, timeout: float) -> dict:
    t0 = time.time()
    cmd = [sys.executable, __file__, "--child", mode, "--ckpt", str(ckpt), "--bundle", str(bundle), "--out", str(out)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        first = next((float(x.split()[1]) for x in text.splitlines() if x.startswith("FIRST ")), None)
        return {"mode": mode, "error": "no result within %.0f s" % timeout,
                "start_to_first_s": (first - t0) if first else None}
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    (out / ("log_%s.txt" % mode.replace(":", "_"))).write_text(p.stdout[-20000:] + "\n" + p.stderr[-20000:])
    if p.returncode != 0 or line is None:
        return {"mode": mode, "error": "exit %d: %s" % (p.returncode, (p.stderr.strip().splitlines() or [""])[-1][:300])}
    r = json.loads(line[7:])
    r["start_to_first_s"] = r["t_first"] - t0
    return r


def agreement(out: Path, mode: str) -> dict:
    import torch

    ref_path, got_path = out / "outputs_eager.pt", out / ("outputs_%s.pt" % mode.replace(":", "_"))
    if not (ref_path.exists() and got_path.exists()):
        return {}
    ref, got = torch.load(ref_path), torch.load(got_path)
    return {k: {"option": float((ref[k][0] - got[k][0]).abs().max()), "action": float((ref[k][1] - got[k][1]).abs().max())}
            for k in ref if k in got}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--ckpt", default="/tmp/laya-large-1024")
    ap.add_argument("--bundle", default="/tmp/bundle-large-1024")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--shape", default="large-1024")
    ap.add_argument("--modes", default="eager,bundle:compile,bundle:aoti,fast,compile")
    ap.add_argument("--build-args", default="stages.onnx=false stages.tilelang=false")
    ap.add_argument("--timeout", type=float, default=240)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.child:
        child(a.child, a.ckpt, a.bundle, str(out))
        return
    command = "python3 benchmarks/gpu_bench.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    ckpt, bundle = Path(a.ckpt), Path(a.bundle)
    t0 = time.time()
    subprocess.check_call([sys.executable, "-m", "laya_aot.cli", "make-demo", str(ckpt), "--shape", a.shape])
    made_s = time.time() - t0
    build = {}
    if not (bundle / "bundle.json").exists():
        t0 = time.time()
        p = subprocess.run([sys.executable, "-m", "laya_aot.cli", "build", "checkpoint.path=%s" % ckpt, "target=sm_90",
                            "output_dir=%s" % bundle, *a.build_args.split()], capture_output=True, text=True)
        (out / "build_log.txt").write_text(p.stdout[-20000:] + "\n" + p.stderr[-30000:])
        build = {"rc": p.returncode, "seconds": time.time() - t0}
        if (bundle / "bundle.json").exists():
            m = json.loads((bundle / "bundle.json").read_text())
            build["stages"] = [{k: s.get(k) for k in ("name", "status", "seconds", "error")} for s in m["stages"]]
            build["artifacts"] = [{k: x.get(k) for k in ("name", "status", "variant", "size", "build_seconds")}
                                  | {"verify": {k: (x.get("verify") or {}).get(k) for k in
                                                ("passed", "reason", "max_abs_option_prob", "max_abs_action_prob")}}
                                  for x in m["artifacts"]]
    results = {"command": command, "checkpoint": a.shape, "checkpoint_write_s": made_s, "build": build, "modes": {}}
    for mode in a.modes.split(","):
        r = spawn(mode, ckpt, bundle, out, a.timeout)
        r["agreement_with_eager"] = agreement(out, mode) if mode != "eager" else {}
        results["modes"][mode] = r
        (out / ("gpu_%s.json" % a.shape)).write_text(json.dumps(results, indent=2))
        print(mode, json.dumps({k: r.get(k) for k in ("backend", "start_to_first_s", "latency_ms", "error")}), flush=True)
    (out / ("gpu_%s.md" % a.shape)).write_text(markdown(results))
    print(markdown(results))


def markdown(r: dict) -> str:
    keys = ["%dx%dx4" % s for s in SHAPES]
    lines = ["# GPU benchmark, checkpoint `%s` (one H200)" % r["checkpoint"], "", "Command: `%s`" % r["command"], "",
             "| mode | backend | start -> first answer | " + " | ".join(keys) + " (ms) | peak GB @32x1024 | max dp vs eager |",
             "|---|---|---|" + "---|" * len(keys) + "---|---|"]
    for mode, m in r["modes"].items():
        lat = m.get("latency_ms") or {}
        agree = m.get("agreement_with_eager") or {}
        worst = max((max(v.values()) for v in agree.values()), default=None)
        first = m.get("start_to_first_s")
        lines.append("| %s | %s | %s | %s | %s | %s |" % (
            mode, m.get("backend", "-"),
            ("%.1f s" % first if first else "-") + (" (%s)" % m["error"] if m.get("error") else ""),
            " | ".join("%.2f" % lat[k] if k in lat else "-" for k in keys),
            "%.2f" % m["peak_gb_32x1024x4"] if "peak_gb_32x1024x4" in m else "-",
            "%.3g" % worst if worst is not None else "-"))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

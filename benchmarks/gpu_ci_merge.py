"""GPU check of the CI flow (issue 13): parts built on a CPU machine, joined with a part built on this GPU.

On the GPU host, after the .device-site unpack line, with the CPU machine's packs carried in IN:

    python3 benchmarks/gpu_ci_merge.py --inputs artifacts/ci-in --out $OUT

IN holds cpu.tar.zst and tilelang.tar.zst (`laya-aot pack` of the README's two CPU-machine builds of
checkpoint=demo: target=cpu, and target=cuda-all with TileLang only) and ckpt.tar.xz (the demo checkpoint
those builds made). Here: unpack both packs, build the sm_90 part on this GPU (the workflow's gpu job:
AOTInductor and the compile route), merge the three, verify, pack, unpack into a fresh directory, then load
the result with strict=True in fresh processes: each of aoti, tilelang (cross-compiled on the CPU machine,
verified by this first GPU that loads it) and compile on cuda, and the default choice on the CPU. Every
command and its exit status go to ci_merge.md/json under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MARK = "CI-MERGE-LOAD "
LOAD = r"""
import json, sys, time, warnings
import laya_aot
from laya_aot.demo import question_suite
import laya
t = time.perf_counter()
agent = laya_aot.load(sys.argv[1], bundle=sys.argv[2], device=sys.argv[3], prefer=sys.argv[4] or None, strict=True)
qs = dict(list(question_suite().items())[:20])
states = ["my package arrived damaged and support never answered", "thanks, all good now"]
got = agent.predict_batch(states, qs)
eager = laya.load(sys.argv[1], device=sys.argv[3]).predict_batch(states, qs)
def dec(a):
    if a["type"] == "choice": return a["choice"]
    if a["type"] == "score": return max(a["probabilities"], key=a["probabilities"].get)
    return a["noul"] > 0.5
same = sum(dec(g["answers"][q]) == dec(e["answers"][q]) for g, e in zip(got, eager) for q in e["answers"])
art = agent.backend_object.artifact
print("%s%s" % (sys.argv[5], json.dumps({"backend": agent.backend, "artifact": art.name, "status": art.status,
      "load_stats": agent.backend_object.load_stats, "decisions_equal_eager": same,
      "decisions": len(qs) * len(states), "seconds": round(time.perf_counter() - t, 2)}, default=str)))
"""


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--inputs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/ci-merge")
    p.add_argument("--loads-only", action="store_true")
    p.add_argument("--tilelang-here", action="store_true",
                   help="cross-compile the TileLang part on this host with no GPU visible instead of unpacking it")
    a = p.parse_args()
    inp, out, work = Path(a.inputs).resolve(), Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    steps = []
    cli = [sys.executable, "-m", "laya_aot.cli"]

    def step(name, cmd, **kw):
        t0 = time.time()
        r = subprocess.run(cmd, cwd=work, capture_output=True, text=True, **kw)
        rec = {"step": name, "cmd": " ".join(str(c) for c in cmd), "rc": r.returncode,
               "seconds": round(time.time() - t0, 1),
               "tail": "\n".join(x for x in (r.stdout + r.stderr).splitlines()
                                 if "kernel/s" not in x and not x.startswith(("│", "┃", "┏", "┡", "└")))[-2500:]}
        steps.append(rec)
        print("%s: rc %d in %.1f s" % (name, r.returncode, rec["seconds"]), flush=True)
        save()
        return r

    def save():
        (out / "ci_merge.json").write_text(json.dumps({"steps": steps}, indent=1))
        lines = ["Command: `python3 benchmarks/gpu_ci_merge.py %s`" % " ".join(sys.argv[1:]), "",
                 "| step | rc | s | command |", "|---|---|---|---|"]
        lines += ["| %s | %d | %.1f | `%s` |" % (s["step"], s["rc"], s["seconds"], s["cmd"].replace(sys.executable,
                                                                                                  "python3"))
                  for s in steps]
        for s in steps:
            lines += ["", "### %s" % s["step"], "```", s["tail"], "```"]
        (out / "ci_merge.md").write_text("\n".join(lines) + "\n")

    if a.loads_only:  # a second pass over a --work directory the full run left (same warm host)
        step("verify here (again, for its output)", cli + ["verify", "artifacts/demo", "--checkpoint",
                                                            "artifacts/checkpoints/demo-tiny-seed0"])
        return _loads(step, work, a, out, save)
    (work / "artifacts" / "checkpoints").mkdir(parents=True, exist_ok=True)
    step("checkpoint from the CPU machine", ["tar", "-xJf", str(inp / "ckpt.tar.xz"), "-C", "artifacts/checkpoints"])
    step("unpack the cpu part", cli + ["unpack", str(inp / "cpu.tar.zst"), "parts/demo/cpu"])
    if a.tilelang_here:  # cross-compiled with no GPU visible, by this host's torch (merge refuses mixed torch builds)
        step("cpu job: TileLang for sm_90a cross-compiled here with no GPU visible",
             cli + ["build", "checkpoint=demo", "target=sm_90", "stages.aoti=false", "stages.onnx=false",
                    "stages.inductor_cache=false", "output_dir=parts/demo/tilelang"],
             env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    else:
        step("unpack the tilelang part", cli + ["unpack", str(inp / "tilelang.tar.zst"), "parts/demo/tilelang"])
    step("gpu job: build the sm_90 part here", cli + ["build", "checkpoint=demo", "target=sm_90", "stages.onnx=false",
                                                      "stages.tilelang=false", "output_dir=parts/demo/sm_90"])
    step("merge", cli + ["merge", "artifacts/demo", "parts/demo/cpu", "parts/demo/tilelang", "parts/demo/sm_90"])
    step("verify here", cli + ["verify", "artifacts/demo", "--checkpoint", "artifacts/checkpoints/demo-tiny-seed0"])
    step("pack", cli + ["pack", "artifacts/demo", "demo.tar.zst"])
    step("unpack into a fresh directory", cli + ["unpack", "demo.tar.zst", "fresh/demo"])
    step("inspect", cli + ["inspect", "fresh/demo"])
    return _loads(step, work, a, out, save, steps)


def _loads(step, work, a, out, save, steps=None) -> int:
    for device, prefer in (("cuda", "aoti"), ("cuda", "tilelang"), ("cuda", "compile"), ("cpu", "")):
        step("load strict on %s, prefer=%s" % (device, prefer or "(best)"),
             [sys.executable, "-c", LOAD, "artifacts/checkpoints/demo-tiny-seed0", "fresh/demo", device, prefer, MARK],
             env=dict(os.environ, LAYA_AOT_CACHE_DIR=str(work / ("cache-%s-%s" % (device, prefer))),
                      TORCHINDUCTOR_CACHE_DIR=str(work / ("inductor-%s-%s" % (device, prefer)))))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())

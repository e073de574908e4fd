"""GPU check of the CI flow: parts built on a CPU machine, joined with a part built on this GPU.

On the GPU host, with the CPU machine's packs carried in IN:

    python3 benchmarks/gpu_ci_merge.py --inputs artifacts/ci-in [--tilelang-here]

IN holds cpu.tar.zst and tilelang.tar.zst (`laya-aot pack` of the README's two CPU-machine builds of
checkpoint=demo: target=cpu, and target=cuda-all with TileLang only) and ckpt.tar.xz (the demo checkpoint
those builds made). Here: unpack both packs, build the sm_90 part on this GPU (the workflow's gpu job:
AOTInductor and the compile route), merge the three, verify, pack, unpack into a fresh directory, then load
the result with strict=True in fresh processes: each of aoti, tilelang (cross-compiled on the CPU machine,
verified by this first GPU that loads it) and compile on cuda, and the default choice on the CPU.
`--tilelang-here` cross-compiles the TileLang part on this host with no GPU visible instead (merge refuses two
parts' exported programs when the CPU machine's torch differs from this host's). Every command and its exit status
go to ci_merge<tag>.md/json under --out.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import harness

MARK = "RESULT"
HERE = Path(__file__).resolve().parent  # the child imports the harness from here
CKPT = "artifacts/checkpoints/demo-tiny-trained-seed0"  # where `checkpoint=demo` puts the demo checkpoint
LOAD = r"""
import sys, time
import laya_aot
from laya_aot.demo import question_suite
import laya
t = time.perf_counter()
agent = laya_aot.load(sys.argv[1], bundle=sys.argv[2], device=sys.argv[3], prefer=sys.argv[4] or None, strict=True)
qs = dict(list(question_suite().items())[:20])
states = ["my package arrived damaged and support never answered", "thanks, all good now"]
got = agent.predict_batch(states, qs)
eager = laya.load(sys.argv[1], device=sys.argv[3]).predict_batch(states, qs)
sys.path.insert(0, sys.argv[6])
import harness
same = sum(harness.decision(g["answers"][q]) == harness.decision(e["answers"][q])
           for g, e in zip(got, eager) for q in e["answers"])
art = agent.backend_object.artifact
harness.emit({"backend": agent.backend, "artifact": art.name, "status": art.status,
              "load_stats": agent.backend_object.load_stats, "decisions_equal_eager": same,
              "decisions": len(qs) * len(states), "seconds": round(time.perf_counter() - t, 2)}, mark=sys.argv[5])
"""


def main() -> int:
    p = harness.parser(__doc__, work=True)
    p.add_argument("--inputs", required=True)
    p.add_argument("--loads-only", action="store_true", help="again over a --work directory a full run left")
    p.add_argument("--tilelang-here", action="store_true",
                   help="cross-compile the TileLang part on this host with no GPU visible instead of unpacking it")
    a = p.parse_args()
    inp, out, work = Path(a.inputs).resolve(), a.out, a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    steps = []
    environment = harness.environment()
    cli = [sys.executable, "-m", "laya_aot.cli"]

    def step(name, cmd, env=None):
        run = harness.spawn(cmd, env=env, cwd=work)
        rec = {"step": name, "cmd": " ".join(str(c) for c in cmd), "rc": run.rc,
               "seconds": round(run.seconds, 1),
               "tail": "\n".join(x for x in (run.stdout + run.stderr).splitlines()
                                 if "kernel/s" not in x and not x.startswith(("│", "┃", "┏", "┡", "└")))[-2500:]}
        steps.append(rec)
        print("%s: rc %s in %.1f s" % (name, run.rc, rec["seconds"]), flush=True)
        save()
        return run

    def save():
        lines = ["| step | rc | s | command |", "|---|---|---|---|"]
        lines += ["| %s | %s | %.1f | `%s` |" % (s["step"], s["rc"], s["seconds"], s["cmd"].replace(sys.executable,
                                                                                                  "python3"))
                  for s in steps]
        for s in steps:
            lines += ["", "### %s" % s["step"], "```", s["tail"], "```"]
        harness.write(out, "ci_merge" + a.tag, {"environment": environment, "steps": steps}, "\n".join(lines),
                      title="The CI flow on a GPU")

    if a.loads_only:  # a second pass over a --work directory the full run left (same warm host)
        step("verify here (again, for its output)", cli + ["verify", "artifacts/demo", "--checkpoint", CKPT])
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
    step("verify here", cli + ["verify", "artifacts/demo", "--checkpoint", CKPT])
    step("pack", cli + ["pack", "artifacts/demo", "demo.tar.zst"])
    step("unpack into a fresh directory", cli + ["unpack", "demo.tar.zst", "fresh/demo"])
    step("inspect", cli + ["inspect", "fresh/demo"])
    return _loads(step, work, a, out, save, steps)


def _loads(step, work, a, out, save, steps=None) -> int:
    for device, prefer in (("cuda", "aoti"), ("cuda", "tilelang"), ("cuda", "compile"), ("cpu", "")):
        step("load strict on %s, prefer=%s" % (device, prefer or "(best)"),
             [sys.executable, "-c", LOAD, CKPT, "fresh/demo", device, prefer, MARK, str(HERE)],
             env=dict(os.environ, LAYA_AOT_CACHE_DIR=str(work / ("cache-%s-%s" % (device, prefer))),
                      TORCHINDUCTOR_CACHE_DIR=str(work / ("inductor-%s-%s" % (device, prefer)))))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""AOTInductor packages of one checkpoint built with different export/compile settings, timed side by side.

A kernel-level A/B on one machine, for settings whose correctness a full `laya-aot build` has already verified
(or checks here only coarsely): each variant is exported and packaged exactly as the build's `exported_program`
and `aoti` stages do it (`ExplicitDtypeModel`, `export_model`, `aoti.package`), in its own process, all variants
at once; then one process loads every package with the checkpoint's weights and times the forward alone at the
forward-only shapes, the variants alternating shape by shape (median of 20 after 3 warm-ups, synchronised; with
each variant's p10 and p90, and its paired ratio to the first variant round by round). Each variant's outputs are
compared with the first variant's on the same inputs (max |d softmax|), which catches a broken package, not a
subtle precision change: that is what the build's verification is for.

    python3 benchmarks/aoti_variants.py --ckpt CKPT --variants table,table+fullhead [--smoke] [--device cpu]
    python3 benchmarks/aoti_variants.py --ckpt CKPT --prebuilt table=BUNDLE/aoti-sm_90 --variants table,table+cdt

A variant is a rotary form (`table` or `computed`, `export.rotary`), optionally with `+autotune`
(`aoti.max_autotune=true`), `+fullhead` (`export.head=full`; otherwise the default head, `answer_rows`) and
`+frozen` (the weights frozen inside, as the CPU build's `aoti-cpu-frozen`), `+hintRxT` (the export's example batch
R rows x T tokens instead of the build's default, `export.example_rows`/`example_tokens`: Inductor tunes its own
kernels' launch settings at the example's sizes), `+cdt` (Inductor's coordinate-descent tuning of those settings),
`+tma` (Inductor's persistent TMA matmul templates among max-autotune's choices, Hopper only), `+nocombo`
(without Inductor's combo kernels, which a GPU build compiles with: independent pointwise kernels launched as
one), `+pdl` (Triton kernels launched with Hopper's programmatic dependent launch, each one's start overlapping
the previous one's end), `+splitmlp` (the GeGLU's halves as two GEMMs, so that with `+autotune` Inductor may
fuse `gelu(a) * g` into the second's epilogue), and `+faithful` (`export.precision=faithful` with fp16 products,
the build's default where activations fit; otherwise laya's autocast policy in `--dtype`).
`--prebuilt VARIANT=DIR` times a package already built (a bundle's `aoti-sm_90/`) instead of compiling it;
`--smoke` first runs each package once per shape in a process of its own, so that a package which breaks the CUDA
context is named and left out rather than ending the run. What these settings measured is in
`benchmarks/results/calls.md`. Writes aoti_variants<tag>.json and .md to --out.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness
from harness import FORWARD_SHAPES as SHAPES


def compile_child(variant: str, ckpt: str, workdir: Path, dtype: str, device: str) -> None:
    """Export and package one variant as the build does; prints one RESULT line."""
    import laya
    from safetensors import safe_open

    from laya_aot import laya_internals as laya_api
    from laya_aot.checkpoint import describe
    from laya_aot.config import CheckpointConfig
    from laya_aot.kinds import aoti
    from laya_aot.kinds.exported_program import export_model
    from laya_aot.kinds.exported_program_settings import ExportConfig
    from laya_aot.modeling.model import ExplicitDtypeModel
    from laya_aot.numerics.dtypes import torch_dtype

    rotary, *extras = variant.split("+")
    e = ExportConfig()
    hint = [x for x in extras if x.startswith("hint")]
    example = tuple(int(n) for n in hint[0][4:].split("x")) if hint else None
    if "cdt" in extras:
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True
    if "pdl" in extras:
        import torch._inductor.config as inductor_config

        inductor_config.triton.enable_pdl = True
    if "tma" in extras:
        import torch._inductor.config as inductor_config

        inductor_config.triton.enable_persistent_tma_matmul = True
    head = "full" if "fullhead" in extras else e.head
    t0 = time.perf_counter()
    agent = laya.load(ckpt, device="cpu")
    max_tokens = int(describe(Path(ckpt), CheckpointConfig(path=ckpt))["max_len"])
    module = ExplicitDtypeModel(agent.model, torch_dtype(dtype), torch_dtype(e.action_head_dtype), device,
                                attention=e.attention, rope_table=max_tokens if rotary == "table" else 0,
                                head=head, gemm=torch_dtype("fp16") if "faithful" in extras else None)
    if "splitmlp" in extras:
        _split_mlp(module)
    program = export_model(module, e.max_rows, max_tokens, e.max_markers, laya_api.pad_id(agent), device, example)
    t1 = time.perf_counter()
    with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    facts = aoti.package(program, workdir / variant, keys, max_autotune="autotune" in extras,
                         frozen="frozen" in extras, combo_kernels=device == "cuda" and "nocombo" not in extras)
    res = {"variant": variant, "rotary": module.rotary, "attention": module.attention, "head": module.head,
           "export_s": round(t1 - t0, 1), "package_s": round(time.perf_counter() - t1, 1), **facts,
           "max_tokens": max_tokens, "template_kernels": template_kernels(workdir / variant / "model.pt2")}
    harness.emit(res)


def template_kernels(package: Path) -> list:
    """The Inductor GEMM-template kernels the package's wrapper launches (`triton_tem_...`), by name: a name with
    `gelu`/`erf` or `mul` after `mm` says an epilogue was fused into the GEMM (what `+splitmlp` is for)."""
    import re
    import zipfile

    if not package.exists():
        return []
    with zipfile.ZipFile(package) as z:
        text = "".join(z.read(n).decode("utf-8", "replace") for n in z.namelist() if n.endswith(".wrapper.cpp"))
    return sorted(set(re.findall(r"triton_tem_fused_\w+", text)))


def _split_mlp(module) -> int:
    """Every ModernBERT MLP of `module` computes its GeGLU's two halves as two GEMMs on slices of Wi's weight,
    so that `gelu(a) * g` is a pointwise epilogue of the second (an Inductor GEMM template can fuse it there; one
    GEMM's output split into two column halves cannot). The same dot products: outputs equal to the default's in
    fp32 on the CPU. Returns how many MLPs were changed."""
    import types

    import torch.nn.functional as F

    def forward(self, hidden_states):
        n = self.Wi.out_features // 2
        w, b = self.Wi.weight, self.Wi.bias
        a = F.linear(hidden_states, w[:n], None if b is None else b[:n])
        g = F.linear(hidden_states, w[n:], None if b is None else b[n:])
        return self.Wo(self.drop(self.act(a) * g))

    mlps = [m for m in module.modules() if type(m).__name__ == "ModernBertMLP"]
    for m in mlps:
        m.forward = types.MethodType(forward, m)
    if not mlps:
        raise SystemExit("+splitmlp: no ModernBertMLP in the model")
    return len(mlps)


def smoke_child(variant: str, ckpt: str, workdir: Path, graphs: bool, device: str, shapes) -> None:
    """Run one package once at every shape; prints one SMOKE line per shape. In a child of its own: a device-side
    assert (seen once in a max-autotune package) ends the CUDA context and would end the timing with it."""
    import torch
    from safetensors.torch import load_file

    from laya_aot.kinds.aoti import AOTIRunner

    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    vocab = harness.vocab_of(tensors)
    runner = AOTIRunner(workdir / variant, tensors, device, cuda_graphs=graphs)
    for rows, length in shapes:
        args = harness.forward_args(rows, length, vocab, device, seed=rows * 10000 + length)
        logits, _ = runner(*args)
        if device == "cuda":
            torch.cuda.synchronize()
        print("SMOKE %s %dx%d ok finite=%s" % (variant, rows, length, bool(torch.isfinite(logits.float()).all())),
              flush=True)


def time_all(variants, ckpt: str, workdir: Path, graphs: bool, device: str, shapes=SHAPES) -> dict:
    import torch
    from safetensors.torch import load_file

    from laya_aot.kinds.aoti import AOTIRunner

    sync = harness.synchronizer(device)
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    vocab = harness.vocab_of(tensors)
    runners = {v: AOTIRunner(workdir / v, tensors, device, cuda_graphs=graphs) for v in variants}
    out: dict = {v: {} for v in variants}
    spread: dict = {v: {} for v in variants}
    paired: dict = {v: {} for v in variants[1:]}
    diffs: dict = {v: {} for v in variants}
    for rows, length in shapes:
        shape = "%dx%dx4" % (rows, length)
        args = harness.forward_args(rows, length, vocab, device, seed=rows * 10000 + length)
        ref = None
        times = {v: [] for v in variants}
        for i in range(23):
            for v in variants:  # alternating: a drift in the machine's state falls on every variant alike
                sync()
                t = time.perf_counter()
                logits, _ = runners[v](*args)
                sync()
                if i >= 3:
                    times[v].append(time.perf_counter() - t)
                if i == 0:
                    p = torch.softmax(logits.float(), -1)
                    ref = p if ref is None else ref
                    diffs[v][shape] = float((p - ref).abs().max())
        for v in variants:
            out[v][shape] = round(statistics.median(times[v]) * 1e3, 3)
            spread[v][shape] = harness.spread([t * 1e3 for t in times[v]])
        for v in variants[1:]:  # each round's time over the first variant's in the same round: a paired figure
            paired[v][shape] = harness.spread([a / b for a, b in zip(times[v], times[variants[0]])], with_median=True)
    return {"forward_ms": out, "forward_ms_p10_p90": spread, "ratio_vs_first": paired, "max_dp_vs_first": diffs}


def markdown(res: dict) -> str:
    shapes = sorted({k for fo in res.get("timed", {}).get("forward_ms", {}).values() for k in fo},
                    key=lambda k: [int(n) for n in k.split("x")])
    lines = ["| variant | export s | package s | " + " | ".join(shapes) + " | max dp vs first |",
             "|---|---|---|" + "---|" * len(shapes) + "---|"]
    for v, c in res["compiled"].items():
        fo = res.get("timed", {}).get("forward_ms", {}).get(v, {})
        dp = res.get("timed", {}).get("max_dp_vs_first", {}).get(v, {})
        lines.append("| %s | %s | %s | %s | %s |" % (
            v, c.get("export_s", "-"),
            c.get("package_s", "prebuilt" if "prebuilt" in c else "failed: %s" % c.get("rc")),
            " | ".join(str(fo.get(s, "-")) for s in shapes), max(dp.values()) if dp else "-"))
    failed = ["%s: failed its smoke run (exit %s): `%s`" % (v, c["smoke"]["rc"], c["smoke"]["error"][-300:])
              for v, c in res["compiled"].items() if c.get("smoke", {}).get("rc")]
    lines += [""] + failed if failed else []
    lines += ["", "Forward only, ms: median of 20 after 3 warm-ups, synchronised, the variants alternating; CUDA "
              "graphs %s." % ("on (as served)" if res.get("graphs") else "off")]
    paired = res.get("timed", {}).get("ratio_vs_first", {})
    if paired:
        first = next(iter(res["compiled"]))
        lines += ["", "Each round's time over `%s`'s in the same round: p10 / median / p90 of 20 rounds." % first, "",
                  "| variant | " + " | ".join(shapes) + " |", "|---|" + "---|" * len(shapes)]
        for v, by_shape in paired.items():
            lines.append("| %s | %s |" % (v, " | ".join(
                " / ".join(str(x) for x in by_shape[sh]) if sh in by_shape else "-" for sh in shapes)))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = harness.parser(__doc__, work=True)
    ap.add_argument("--compile-child")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--variants", default="table,computed")
    ap.add_argument("--no-graphs", action="store_true", help="time the packages without CUDA graphs")
    ap.add_argument("--compile-timeout", type=float, default=420)
    ap.add_argument("--device", default="cuda", help="cpu: on a CPU machine (stock attention)")
    ap.add_argument("--shapes", default=",".join("%dx%d" % s for s in SHAPES))
    ap.add_argument("--prebuilt", action="append", default=[], metavar="VARIANT=DIR",
                    help="a package already built (a bundle's aoti-sm_90 folder): linked in, not compiled")
    ap.add_argument("--smoke", action="store_true",
                    help="before timing, run each package once per shape in a child of its own; time only those "
                         "that pass")
    ap.add_argument("--smoke-child")
    a = ap.parse_args()
    workdir = a.work
    shapes = tuple(harness.shapes_arg(a.shapes))
    if a.compile_child:
        compile_child(a.compile_child, a.ckpt, workdir, a.dtype, a.device)
        return
    if a.smoke_child:
        smoke_child(a.smoke_child, a.ckpt, workdir, not a.no_graphs, a.device, shapes)
        return
    variants = a.variants.split(",")
    res: dict = {"environment": harness.environment(), "graphs": not a.no_graphs, "compiled": {}}
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    prebuilt = dict(item.split("=", 1) for item in a.prebuilt)
    for v, src in prebuilt.items():
        link = workdir / v
        if link.is_symlink() or not link.exists():
            link.unlink(missing_ok=True)
            link.symlink_to(Path(src).resolve())
        res["compiled"][v] = {"prebuilt": src, "package_bytes": (link / "model.pt2").stat().st_size}
    child = [sys.executable, __file__, "--ckpt", a.ckpt, "--work", str(workdir), "--dtype", a.dtype,
             "--device", a.device, "--compile-child"]
    t0 = time.time()
    procs = {v: subprocess.Popen(child + [v], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for v in variants if v not in prebuilt}
    deadline = time.monotonic() + a.compile_timeout  # one limit for all: the children compile side by side
    for v, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        res["compiled"][v] = harness.ChildRun(p.returncode, stdout, stderr, t0).result_or_failure()
        (out / ("aoti_variants%s_%s.log" % (a.tag, v.replace("+", "_")))).write_text(stdout[-20000:] + stderr[-20000:])
        print(v, json.dumps(res["compiled"][v], default=str)[:400], flush=True)
    ok = [v for v in variants if "package_bytes" in res["compiled"][v]]
    if a.smoke:
        smoke = [sys.executable, __file__, "--ckpt", a.ckpt, "--work", str(workdir), "--device", a.device,
                 "--shapes", a.shapes] + (["--no-graphs"] if a.no_graphs else []) + ["--smoke-child"]
        for v in list(ok):
            run = harness.spawn(smoke + [v], timeout=300, env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"})
            lines = [line for line in run.stdout.splitlines() if line.startswith("SMOKE ")]
            res["compiled"][v]["smoke"] = {"rc": run.rc, "passed": lines,
                                           "error": "" if run.rc == 0 else run.stderr[-1500:]}
            print(v, "smoke rc", run.rc, lines, run.stderr[-600:] if run.rc else "", flush=True)
            if run.rc != 0:
                ok.remove(v)
    if ok:
        res["timed"] = time_all(ok, a.ckpt, workdir, not a.no_graphs, a.device, shapes)
    harness.write(out, "aoti_variants" + a.tag, res, markdown(res), title="AOTInductor variants, one machine")


if __name__ == "__main__":
    main()

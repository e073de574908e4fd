"""GPU benchmark: precompiled TileLang bundle vs laya's own `fast=True` (JIT) path.

Each path runs in its own fresh process, started by this script, and measures
  - process start (spawn) to first answer: a 1x128x4 forward, synchronised;
  - per shape (rows x tokens x markers): the first call (CUDA-graph capture, plus JIT for laya),
    then the median of 20 calls timed with CUDA events after 3 warm-ups;
  - compile attempts, counted at every TileLang/nvcc compile entry (benchmarks/jit_guard.py).
The bundle process runs with nvcc absent (PATH stripped, CUDA_HOME an empty directory), an empty
TileLang cache directory, and every compile entry patched to raise: one compile would fail it.
The laya process starts with an empty TileLang cache (cold, like a fresh host). Outputs of
both are saved and compared bit for bit.

    python3 benchmarks/gpu_tilelang.py --ckpt CKPT --bundle BUNDLE/tilelang [--budget-s 360] [--ab]

`--bundle` is a directory holding `<arch>/`, such as a laya-aot bundle's `tilelang/`. `--ab` adds an interleaved
same-process latency comparison (7 rounds of 20 calls per shape; LAYA_AOT_AB_TL_CACHE names a TileLang cache in
which laya's own kernels are already compiled, LAYA_AOT_AB_SHAPES limits the shapes).
Writes gpu_tilelang<tag>.json and .md to --out.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import harness

SHAPES = [(1, 128, 4), (8, 256, 4), (32, 512, 4), (32, 1024, 4)]
REPEATS, WARMUP = 20, 3


# ------------------------------------------------------------------------------------ child
def _inputs(rows, tokens, markers, vocab, device):
    """Deterministic collated batch: ragged lengths, markers inside each row, mixed qtypes."""
    import torch

    g = torch.Generator().manual_seed(rows * 100_003 + tokens * 101 + markers)
    ids = torch.randint(5, vocab, (rows, tokens), generator=g)
    lens = torch.tensor([tokens - (i * 7) % max(1, tokens // 4) for i in range(rows)])
    mask = (torch.arange(tokens)[None, :] < lens[:, None]).long()
    ids = ids * mask
    pos = torch.stack([torch.randint(1, int(n), (markers,), generator=g) for n in lens])
    mmask = torch.ones(rows, markers, dtype=torch.bool)
    qtype = torch.randint(0, 3, (rows,), generator=g)
    return [t.to(device) for t in (ids, mask, pos, mmask, qtype)]


def _time_shape(model, inputs):
    import torch

    t0 = time.perf_counter()
    out = model(*inputs)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(WARMUP):
        model(*inputs)
    return out, first, _median_ms(model, inputs)


TINY_SHAPES = [(1, 64, 3), (4, 128, 3), (8, 256, 3)]


def child_tiny(a) -> int:
    """Tiny demo (head dim 16, head attention 1x64): bundle forward vs laya's stock eager forward."""
    import laya
    import torch
    from jit_guard import jit_guard

    from laya_aot.kernels import PrecompiledTileLangBackend, detect_arch

    res = {"mode": "tiny", "nvcc_on_path": shutil.which("nvcc"), "shapes": {}}
    with jit_guard(forbid=True) as attempts:
        agent = laya.load(a.ckpt, device="cuda")
        vocab = min(agent.model.encoder.config.vocab_size, 1200)
        inputs = {s: _inputs(*s, vocab, "cuda") for s in TINY_SHAPES}
        with torch.no_grad(), torch.autocast("cuda", dtype=agent.dtype):
            eager = {s: [t.float() for t in agent.model(*x)] for s, x in inputs.items()}
        backend = PrecompiledTileLangBackend(agent, Path(a.bundle), arch=detect_arch())
        backend.install()
        with torch.no_grad():
            for s, x in inputs.items():
                fast = [t.float() for t in agent.model(*x)]
                pe, pf = torch.softmax(eager[s][0], -1), torch.softmax(fast[0], -1)
                res["shapes"]["x".join(map(str, s))] = {
                    "max_abs_diff_logits": float((eager[s][0] - fast[0]).abs().max()),
                    "max_abs_diff_probs": float((pe - pf).abs().max()),
                    "max_abs_diff_act_logits": float((eager[s][1] - fast[1]).abs().max()),
                    "argmax_agree": bool((pe.argmax(-1) == pf.argmax(-1)).all()),
                    "finite": bool(torch.isfinite(fast[0]).all())}
    res["compile_attempts"] = dict(attempts)
    Path(a.result).write_text(json.dumps(res, indent=1))
    return 0


AB_ROUNDS = 7


def _forget_factory_caches():
    from laya import tl_kernels

    from laya_aot.kernels.catalogue import FACTORIES

    for name in FACTORIES:
        getattr(tl_kernels, name)._kernel_cache.clear()
        getattr(tl_kernels, name)._call_form_cache.clear()


def _median_ms(model, inputs):
    return harness.cuda_event_ms(lambda: model(*inputs), REPEATS, warmup=0)


def child_ab(a) -> int:
    """Latency A/B in one process, interleaved: the bundle path vs laya's fast=True path.

    Separate processes differ in CPU/GPU clock state and warm-up, which dominates on the small,
    CPU-bound shapes; alternating the two agents round by round removes that. laya's agent is
    built first and warmed on every shape (its kernels JIT-compiled), then the factories' caches
    are cleared so the bundle agent loads its own kernels; each FastLaya keeps its own handles."""
    import laya
    import torch
    from jit_guard import jit_guard

    from laya_aot.kernels import PrecompiledTileLangBackend, detect_arch

    res = {"mode": "ab", "rounds": AB_ROUNDS, "repeats": REPEATS}
    with jit_guard(forbid=False) as laya_attempts:
        agent_b = laya.load(a.ckpt, device="cuda", fast=True)
        vocab = min(agent_b.model.encoder.config.vocab_size, 4000)
        only = [t for t in os.environ.get("LAYA_AOT_AB_SHAPES", "").split(",") if t]
        inputs = {s: _inputs(*s, vocab, "cuda") for s in SHAPES if not only or "x".join(map(str, s)) in only}
        with torch.no_grad():
            for x in inputs.values():
                for _ in range(WARMUP):
                    agent_b.model(*x)
    res["laya_compile_attempts"] = dict(laya_attempts)
    _forget_factory_caches()
    with jit_guard(forbid=True) as bundle_attempts:
        agent_a = laya.load(a.ckpt, device="cuda")
        backend = PrecompiledTileLangBackend(agent_a, Path(a.bundle), arch=detect_arch())
        backend.install()
        with torch.no_grad():
            for x in inputs.values():
                for _ in range(WARMUP):
                    agent_a.childl(*x)
    libs_a = {k.adapter.libpath for k in backend.fast._attn_k.values()}
    libs_b = {getattr(k.adapter, "libpath", None) for k in agent_b._fast._attn_k.values()}
    res["bundle_attn_kernels_from_bundle"] = all(str(p).startswith(str(Path(a.bundle))) for p in libs_a)
    res["laya_attn_kernels_from_bundle"] = any(p and str(p).startswith(str(Path(a.bundle))) for p in libs_b)
    res["shapes"] = {}
    with torch.no_grad():
        for s, x in inputs.items():
            ma, mb = [], []
            for _ in range(AB_ROUNDS):
                with jit_guard(forbid=True) as g:
                    ma.append(_median_ms(agent_a.childl, x))
                assert sum(g.values()) == 0
                mb.append(_median_ms(agent_b.model, x))
            ma.sort(), mb.sort()
            key = "x".join(map(str, s))
            res["shapes"][key] = {"bundle_median_ms": ma[len(ma) // 2], "laya_median_ms": mb[len(mb) // 2],
                                  "ratio_bundle_over_laya": ma[len(ma) // 2] / mb[len(mb) // 2],
                                  "bundle_rounds_ms": ma, "laya_rounds_ms": mb,
                                  "bitwise_equal": all(torch.equal(p.float(), q.float()) for p, q in
                                                       zip(agent_a.childl(*x), agent_b.model(*x)))}
            print("[ab] %s bundle %.3f ms laya %.3f ms" % (key, ma[len(ma) // 2], mb[len(mb) // 2]), flush=True)
    res["bundle_compile_attempts"] = dict(bundle_attempts)
    Path(a.result).write_text(json.dumps(res, indent=1))
    return 0


def child(a) -> int:
    if a.child == "tiny":
        return child_tiny(a)
    if a.child == "ab":
        return child_ab(a)
    t_spawn = float(os.environ["LAYA_AOT_T_SPAWN"])
    import laya
    import torch
    from jit_guard import jit_guard

    res = {"mode": a.child, "nvcc_on_path": shutil.which("nvcc"), "python_import_s": time.time() - t_spawn}
    import tilelang.env as tl_env

    res["tilelang_cuda_home"] = tl_env.CUDA_HOME
    outputs = {}
    with jit_guard(forbid=(a.child == "bundle")) as attempts:
        t0 = time.time()
        if a.child == "bundle":
            from laya_aot.kernels import PrecompiledTileLangBackend, detect_arch

            agent = laya.load(a.ckpt, device="cuda")
            res["laya_load_s"] = time.time() - t0
            t1 = time.time()
            backend = PrecompiledTileLangBackend(agent, Path(a.bundle), arch=detect_arch())
            backend.install()
            res["bundle_install_s"] = time.time() - t1
            # construction loads only its own kernels; a call loads its shape's; the rest load in the background
            res["bundle_kernels_loaded"] = backend.runner.stats["kernels_at_construction"]
            res["bundle_load_kernels_s"] = backend.runner.bundle.load_seconds
            res["arch"] = backend.runner.bundle.arch
        else:
            agent = laya.load(a.ckpt, device="cuda", fast=True)
            res["laya_load_s"] = time.time() - t0
            res["fast_enabled"] = agent.backend
        vocab = agent.model.encoder.config.vocab_size
        model = agent.model
        first_in = _inputs(*SHAPES[0], min(vocab, 4000), "cuda")
        with torch.no_grad():
            model(*first_in)
            torch.cuda.synchronize()
            res["start_to_first_answer_s"] = time.time() - t_spawn
            if a.child == "bundle":
                res["kernels_before_first_answer"] = backend.runner.stats["kernels_before_first_answer"]
            res["shapes"] = {}
            for shape in SHAPES:
                key = "x".join(map(str, shape))
                out, first, med = _time_shape(model, _inputs(*shape, min(vocab, 4000), "cuda"))
                outputs[key] = [t.detach().float().cpu().clone() for t in out]
                res["shapes"][key] = {"first_call_s": first, "median_ms": med,
                                      "compile_attempts_so_far": sum(attempts.values())}
                print("[%s] %s first %.3f s, median %.3f ms" % (a.child, key, first, med), flush=True)
    res["compile_attempts"] = dict(attempts)
    if a.child == "bundle":
        backend.runner.wait_preloaded(120)
        res["kernel_preload"] = {k: v for k, v in backend.runner.stats.items() if k.startswith("background")}
    res["device"] = torch.cuda.get_device_name()
    res["versions"] = {"torch": torch.__version__, "laya": laya.__version__,
                       "tilelang": __import__("tilelang").__version__}
    torch.save(outputs, a.outputs)
    Path(a.result).write_text(json.dumps(res, indent=1))
    return 0


# ------------------------------------------------------------------------------------ parent
def _no_nvcc_env(tmp: Path) -> dict:
    env = harness.without_nvcc(dict(os.environ))
    empty = tmp / "no-cuda-home"
    empty.mkdir(exist_ok=True)
    env["CUDA_HOME"] = str(empty)
    env.pop("CUDA_PATH", None)
    return env


def _spawn(mode, a, tmp: Path, env: dict, timeout: float, ckpt=None, bundle=None) -> dict:
    result, outputs = tmp / ("%s.json" % mode), tmp / ("%s.pt" % mode)
    shutil.rmtree(tmp / ("tl-cache-" + mode), ignore_errors=True)  # every run starts with a cold TileLang cache
    result.unlink(missing_ok=True)
    env = dict(env, LAYA_AOT_T_SPAWN=repr(time.time()), PYTHONUNBUFFERED="1",
               TILELANG_CACHE_DIR=os.environ.get("LAYA_AOT_AB_TL_CACHE" if mode == "ab" else "-", "")
               or str(tmp / ("tl-cache-" + mode)))
    run = harness.spawn([sys.executable, __file__, "--child", mode, "--ckpt", ckpt or a.ckpt, "--bundle",
                         bundle or a.bundle, "--result", str(result), "--outputs", str(outputs)], env=env,
                        timeout=timeout)
    rc = run.rc if run.rc is not None else "timeout after %.0f s" % timeout
    log = run.stdout + run.stderr
    (tmp / ("%s.log" % mode)).write_text(log)
    res = json.loads(result.read_text()) if result.exists() else {}
    res.update(rc=rc, wall_s=time.time() - run.started, outputs_file=str(outputs) if outputs.exists() else None)
    if rc != 0:
        res["log_tail"] = log[-4000:]
    return res


def _compare(bundle: dict, fast: dict) -> dict:
    import torch

    if not (bundle.get("outputs_file") and fast.get("outputs_file")):
        return {"compared": False}
    ob, of = torch.load(bundle["outputs_file"]), torch.load(fast["outputs_file"])
    out = {}
    for key in ob:
        if key in of:
            out[key] = {"bitwise_equal": all(torch.equal(x, y) for x, y in zip(ob[key], of[key])),
                        "max_abs_diff": max(float((x - y).abs().max()) for x, y in zip(ob[key], of[key])),
                        "latency_ratio_bundle_over_laya": bundle["shapes"][key]["median_ms"]
                        / fast["shapes"][key]["median_ms"]}
    return out


def parent(a) -> int:
    tmp = a.work
    tmp.mkdir(parents=True, exist_ok=True)
    t_end = time.time() + a.budget_s
    report = {"environment": harness.environment(), "shapes": SHAPES, "repeats": REPEATS, "warmup": WARMUP}
    strict = _no_nvcc_env(tmp)
    report["bundle"] = ({"rc": "skipped"} if a.skip_bundle else
                        _spawn("bundle", a, tmp, strict, timeout=min(200, t_end - time.time())))
    if report["bundle"]["rc"] not in (0, "skipped") and "libcudart" in report["bundle"].get("log_tail", ""):
        # CUDA_HOME also steers where TileLang's cudart stub looks; keep nvcc off PATH, drop the override
        lenient = dict(strict)
        lenient.pop("CUDA_HOME")
        report["bundle_first_try"] = report["bundle"]
        report["bundle"] = _spawn("bundle", a, tmp, lenient, timeout=min(200, t_end - time.time()))
    if a.ab:
        report["ab"] = _spawn("ab", a, tmp, dict(os.environ), timeout=max(10, t_end - time.time()))
    if not a.skip_baseline:
        reserve = 40 if a.tiny_ckpt else 0
        report["laya_fast"] = _spawn("laya-fast", a, tmp, dict(os.environ),
                                     timeout=max(10, t_end - time.time() - reserve))
        report["comparison"] = _compare(report["bundle"], report["laya_fast"]) if not a.skip_bundle else {}
    if a.tiny_ckpt and t_end - time.time() > 15:
        report["tiny_vs_eager"] = _spawn("tiny", a, tmp, strict, timeout=t_end - time.time(),
                                         ckpt=a.tiny_ckpt, bundle=a.tiny_bundle)
    harness.write(a.out, "gpu_tilelang" + a.tag, report, markdown(report),
                  title="Precompiled TileLang kernels against laya's fast=True")
    return 0


def markdown(r: dict) -> str:
    lines = ["| path | rc | start -> first answer (s) | " + " | ".join("x".join(map(str, s)) + " ms" for s in SHAPES)
             + " | compile attempts |", "|---|---|---|" + "---|" * len(SHAPES) + "---|"]
    for name in ("bundle", "laya_fast"):
        x = r.get(name) or {}
        if not x:
            continue
        lines.append("| %s | %s | %s | %s | %s |" % (
            name, x.get("rc"), x.get("start_to_first_answer_s", "-"),
            " | ".join(str((x.get("shapes") or {}).get("x".join(map(str, s)), {}).get("median_ms", "-"))
                       for s in SHAPES),
            sum((x.get("compile_attempts") or {}).values())))
    for key, c in (r.get("comparison") or {}).items():
        if isinstance(c, dict):
            lines.append("\n%s: bitwise equal %s, bundle / laya %.3f" % (key, c["bitwise_equal"],
                                                                       c["latency_ratio_bundle_over_laya"]))
    for key, c in ((r.get("ab") or {}).get("shapes") or {}).items():
        lines.append("\nA/B in one process, %s: bundle %.3f ms, laya %.3f ms (%.3fx), bitwise equal %s" % (
            key, c["bundle_median_ms"], c["laya_median_ms"], c["ratio_bundle_over_laya"], c["bitwise_equal"]))
    return "\n".join(lines) + "\n"


def main() -> int:
    p = harness.parser(__doc__, work=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--bundle", required=True, help="directory holding <arch>/ (a bundle's tilelang/)")
    p.add_argument("--budget-s", type=float, default=360)
    p.add_argument("--skip-baseline", action="store_true", help="skip the cold laya fast=True process")
    p.add_argument("--skip-bundle", action="store_true", help="skip the cold bundle process")
    p.add_argument("--ab", action="store_true", help="also run the interleaved same-process latency A/B")
    p.add_argument("--tiny-ckpt", default=None, help="optional: tiny demo checkpoint for a bundle-vs-eager check")
    p.add_argument("--tiny-bundle", default=None)
    p.add_argument("--child", choices=["bundle", "laya-fast", "tiny", "ab"], help="(internal: a child process)")
    p.add_argument("--result", help="(internal: a child process)")
    p.add_argument("--outputs", help="(internal: a child process)")
    a = p.parse_args()
    return child(a) if a.child else parent(a)


if __name__ == "__main__":
    sys.exit(main())

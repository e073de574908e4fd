"""Does a fresh process reuse the compile artifact's saved Inductor cache? (CPU or GPU)

    python benchmarks/investigations/compile_cache_check.py --shape tiny [--device cpu] [--out FILE.json]

Process A compiles the demo checkpoint's model as the build does (`build_cache`) and saves the cache
artifacts. Then two fresh processes, each with its own empty Inductor and Triton cache directories,
time their first forward: B loads the saved artifacts first (what `CompileRunner` does), C does not
(a cold `torch.compile`). Each reports Inductor's FX-graph and AOTAutograd cache hit/miss counters,
so "B hits, C misses, B is faster" is what a working cache looks like.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _counters() -> dict:
    from torch._dynamo.utils import counters

    return {k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd") and v}


def child(role: str, ckpt: str, art: str, device: str) -> None:
    import laya
    import torch

    from laya_aot.kinds.inductor_cache import _batch, build_cache
    from laya_aot.padding import Ranges

    agent = laya.load(ckpt, device=device)
    ranges = Ranges(1, 8, 16, int(agent.cfg.get("max_len", 256)), 2, 64)
    dtype = "bf16" if device == "cuda" else "fp32"
    t0 = time.perf_counter()
    if role == "build":
        facts = build_cache(agent, Path(art), ranges, dtype, "fp32", device=device)
        out = {"role": role, "facts": facts}
    else:
        from laya_aot.kinds.inductor_cache import compiled_module, mark_dynamic_batch, no_mha_fastpath

        if role == "load":
            torch.compiler.load_cache_artifacts((Path(art) / "inductor_cache.bin").read_bytes())
        _, fn = compiled_module(agent.model, dtype, "fp32", device)
        with torch.no_grad(), no_mha_fastpath():
            fn(*mark_dynamic_batch(_batch(4, 128, 4, device)))
        out = {"role": role}
    out.update(seconds=round(time.perf_counter() - t0, 2), counters=_counters())
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", nargs=4, metavar=("ROLE", "CKPT", "ART", "DEVICE"))
    a = ap.parse_args()
    if a.child:
        child(*a.child)
        return
    from laya_aot.demo import make_checkpoint

    work = Path(tempfile.mkdtemp(prefix="compile-cache-check-"))
    ckpt = make_checkpoint(work / "ckpt", a.shape)
    art = work / "art"
    results = {"command": "python benchmarks/investigations/compile_cache_check.py " + " ".join(sys.argv[1:]), "runs": []}
    for role in ("build", "load", "cold"):
        caches = work / ("caches-" + role)
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), TRITON_CACHE_DIR=str(caches / "triton"))
        t0 = time.time()
        p = subprocess.run([sys.executable, __file__, "--child", role, str(ckpt), str(art), a.device],
                           capture_output=True, text=True, env=env)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        r = json.loads(line[7:]) if line else {"role": role, "error": p.stderr[-2000:]}
        r["process_s"] = round(time.time() - t0, 2)
        results["runs"].append(r)
        print(json.dumps(r), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""torch's AOTInductor `load_constants` in a loop, for a native-stack sampler (gdb) to say where its time goes.

    python3 benchmarks/investigations/lc_loop.py BUNDLE CHECKPOINT [--name aoti-sm_90] [--seconds 20]

Session 31 measured 0.30-0.56 s per call on an H200 (torch 2.11) with `user_managed=True`, which skips the copy;
the source of torch 2.13 has nothing in that path that could take so long. Prints its PID, then loops.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from laya_aot import checkpoint as ckpt_mod
from laya_aot import kinds
from laya_aot.bundle_format import read_bundle
from laya_aot.kinds import aoti


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("checkpoint")
    ap.add_argument("--name", default="aoti-sm_90")
    ap.add_argument("--seconds", type=float, default=20.0)
    a = ap.parse_args()
    manifest = read_bundle(Path(a.bundle), kinds.BY_NAME)
    art = next(x for x in manifest.artifacts if x.name == a.name)
    art_dir = Path(a.bundle) / art.path
    consts = aoti.prepare(art_dir, ckpt_mod.Weights(Path(a.checkpoint)), "cuda")
    if isinstance(consts, kinds.Incoming):
        consts.fill()
        consts = consts.wait()
    pkg = aoti.load_aoti(art_dir, 0)
    mine = {k: v for k, v in consts.items() if k in set(pkg.get_constant_fqns())}
    print("PID", os.getpid(), flush=True)
    end, n = time.monotonic() + a.seconds, 0
    while time.monotonic() < end:
        t = time.perf_counter()
        pkg.load_constants(mine, check_full_update=True, user_managed=True)
        torch.cuda.synchronize()
        n += 1
        print("load_constants %.3f s" % (time.perf_counter() - t), flush=True)


if __name__ == "__main__":
    main()

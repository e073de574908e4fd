"""Where does the tail of a later GPU start go (session 30, written for the next device call)?

    python3 benchmarks/investigations/start_tail.py BUNDLE CHECKPOINT [--name aoti-sm_90] [--device cuda]

A later start of `large-1024` on the H200 answered after 5.05-5.40 s against a floor (import torch and laya,
CUDA context) of 4.08 s. Inside the head start: package 0.12 s, then 0.43 s inside torch's AOTInductor
`load_constants` although the constants are handed over `user_managed` (0.3 ms for 171 tensors with torch 2.13
on the CPU), then a warm-up call 0.33-0.46 s, then the loader's smoke check 0.15 s. This repeats those steps
in one fresh process, one at a time, each synchronised and timed, and asks of each the question that decides
what to cut: does `load_constants` cost the same a second time and without `user_managed` (what signature does
this torch's loader take)? Is the warm-up's time the first call at any shape (module loading) or its shape
(a second, larger call after it)? Does the smoke batch cost a forward once the warm-up ran? Prints one JSON
line.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

T0 = time.perf_counter()
import torch  # noqa: E402

from laya_aot import checkpoint as ckpt_mod  # noqa: E402
from laya_aot.bundle_format import read_bundle  # noqa: E402
from laya_aot import kinds  # noqa: E402
from laya_aot.kinds import aoti  # noqa: E402
from laya_aot.padding import pad_batch, smallest_batch  # noqa: E402
from laya_aot.verification import smoke_from_record  # noqa: E402

IMPORT_S = time.perf_counter() - T0


def timed(res: dict, key: str, fn, device: torch.device):
    """fn's result; its wall time (synchronised on a GPU) under res[key]."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    res[key] = round(time.perf_counter() - t, 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("checkpoint")
    ap.add_argument("--name", default="aoti-sm_90")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    dev = torch.device(a.device)
    res: dict = {"torch": torch.__version__, "import_s": round(IMPORT_S, 3)}
    manifest = read_bundle(Path(a.bundle), kinds.BY_NAME)
    art = next(x for x in manifest.artifacts if x.name == a.name)
    art_dir = Path(a.bundle) / art.path
    if dev.type == "cuda":
        timed(res, "cuda_context_s", lambda: torch.zeros(1, device=dev), dev)
    index = (dev.index or 0) if dev.type == "cuda" else -1
    consts = timed(res, "weights_s", lambda: aoti.prepare(art_dir, ckpt_mod.Weights(Path(a.checkpoint)), a.device),
                   dev)
    if isinstance(consts, kinds.Incoming):  # since session 31 prepare allocates on a GPU; the caller fills
        consts.fill()
        consts = consts.tensors
    pkg = timed(res, "load_package_s", lambda: aoti.load_aoti(art_dir, index), dev)
    res["load_constants_doc"] = (getattr(pkg.loader.load_constants, "__doc__", "") or "")[:600]
    wanted = timed(res, "constant_fqns_s", lambda: set(pkg.get_constant_fqns()), dev)
    mine = {k: v for k, v in consts.items() if k in wanted}
    res["constants"] = len(mine)
    timed(res, "load_constants_user_managed_s",
          lambda: pkg.load_constants(mine, check_full_update=True, user_managed=True), dev)
    timed(res, "load_constants_user_managed_again_s",
          lambda: pkg.load_constants(mine, check_full_update=False, user_managed=True), dev)
    runner = pkg.loader

    def call(batch):
        with torch.no_grad():
            return runner.run([x.to(dev) for x in batch])
    small = smallest_batch(art.ranges)
    timed(res, "first_call_smallest_s", lambda: call(small), dev)
    timed(res, "second_call_smallest_s", lambda: call(small), dev)
    if manifest.smoke is not None:
        batch = pad_batch(smoke_from_record(manifest.smoke)[0], art.ranges, 0)  # as the backend pads it (timing only)
        res["smoke_shape"] = list(batch[0].shape)
        timed(res, "first_call_smoke_s", lambda: call(batch), dev)
        timed(res, "second_call_smoke_s", lambda: call(batch), dev)
    # a second package, constants copied into its own buffer (what `user_managed=False` costs here)
    pkg2 = timed(res, "load_package_again_s", lambda: aoti.load_aoti(art_dir, index), dev)
    timed(res, "load_constants_copied_s",
          lambda: pkg2.load_constants(mine, check_full_update=True, user_managed=False), dev)
    res["total_s"] = round(time.perf_counter() - T0, 3)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()

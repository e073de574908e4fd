"""What a later GPU start's tail is made of, and whether the weights can be handed over before they are written
(session 31, one fresh process; written for the device call `gpu_h200_start/s31/call_s31.sh`).

    python3 benchmarks/investigations/first_calls.py BUNDLE CHECKPOINT [--name aoti-sm_90]

Session 31's first device call (`start_tail.py`, torch 2.11 on an H200) found torch's AOTInductor
`load_constants` taking 0.51-0.56 s with `user_managed=True` and 0.30-0.38 s again or copied, the first call
0.33-0.45 s at the smallest shape and another 0.12-0.18 s at the smoke record's shape. The loader now hands the
package its constants allocated but unwritten (`kinds.Incoming`) and makes its first call while they are
written. That is right only if (a) the package reads user-managed constants in place on this torch (checked:
a weight changed after the hand-over changes the answer), and it gains only if (b) torch's loader and the call
let the interpreter run the copy meanwhile (checked: a counting thread's rate during each, against its rate
alone). Also: which shapes still pay a first call after the smoke shape's (six shapes in turn, each twice),
and what `load_constants` spends its time on (torch.profiler's top entries, last). Prints the JSON object so far
after each part (a part that hangs loses nothing before it).
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

T0 = time.perf_counter()
import torch  # noqa: E402

from laya_aot import checkpoint as ckpt_mod  # noqa: E402
from laya_aot import kinds  # noqa: E402
from laya_aot.bundle_format import read_bundle  # noqa: E402
from laya_aot.kinds import aoti  # noqa: E402
from laya_aot.padding import batch_of_shape, smallest_batch  # noqa: E402

IMPORT_S = time.perf_counter() - T0


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(res: dict, key: str, fn, dev: torch.device):
    sync(dev)
    t = time.perf_counter()
    out = fn()
    sync(dev)
    res[key] = round(time.perf_counter() - t, 4)
    return out


def beside(fn) -> tuple:
    """fn's result, its seconds, and how fast a pure-Python counting thread ran meanwhile (counts per second)."""
    stop, counts = threading.Event(), []

    def spin():
        n = 0
        while not stop.is_set():
            n += 1
        counts.append(n)
    th = threading.Thread(target=spin)
    th.start()
    time.sleep(0.02)
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    stop.set()
    th.join()
    return out, dt, counts[0] / (dt + 0.02)


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
    index = (dev.index or 0) if dev.type == "cuda" else -1
    if dev.type == "cuda":
        timed(res, "cuda_context_s", lambda: torch.zeros(1, device=dev), dev)
    _, _, idle_rate = beside(lambda: time.sleep(0.3))
    incoming = timed(res, "allocate_s", lambda: aoti.prepare(art_dir, ckpt_mod.Weights(Path(a.checkpoint)), a.device),
                     dev)
    consts = incoming.tensors if isinstance(incoming, kinds.Incoming) else incoming
    if isinstance(incoming, kinds.Incoming):
        timed(res, "fill_s", incoming.fill, dev)
    pkg = timed(res, "load_package_s", lambda: aoti.load_aoti(art_dir, index), dev)
    wanted = set(pkg.get_constant_fqns())
    mine = {k: v for k, v in consts.items() if k in wanted}
    res["constants"] = len(mine)
    res["non_float_constants"] = sum(not t.is_floating_point() for t in mine.values())
    _, dt, rate = beside(lambda: pkg.load_constants(mine, check_full_update=True, user_managed=True))
    res.update(load_constants_s=round(dt, 4), load_constants_spin_rate=round(rate / idle_rate, 3))
    run = pkg.loader.run

    def call(batch):
        with torch.no_grad():
            out = run([x.to(dev) for x in batch])
        sync(dev)
        return out
    small = smallest_batch(art.ranges)
    _, dt, rate = beside(lambda: call(small))
    res.update(first_call_smallest_s=round(dt, 4), first_call_spin_rate=round(rate / idle_rate, 3))
    print(json.dumps(res), flush=True)
    shapes = [(2, 48), (1, 80), (8, 384), (24, 384), (32, 512), (32, 1024)]
    firsts = {}
    for rows, tokens in [(r, t) for r, t in shapes if r <= art.ranges.max_rows and t <= art.ranges.max_tokens]:
        b = batch_of_shape(rows, tokens, art.ranges.padded_markers(4))
        r: dict = {}
        timed(r, "first", lambda b=b: call(b), dev)
        timed(r, "second", lambda b=b: call(b), dev)
        firsts["%dx%d" % (rows, tokens)] = r
    res["first_then_second_call_s"] = firsts
    print(json.dumps(res), flush=True)
    # (a) in place: a weight changed after the hand-over changes the answer
    b = batch_of_shape(2, 48, art.ranges.padded_markers(4))
    before = [t.clone() for t in call(b)]
    key = max(mine, key=lambda k: mine[k].numel())
    saved = mine[key].clone()
    mine[key].mul_(0.5)
    changed = [t.clone() for t in call(b)]
    mine[key].copy_(saved)
    again = call(b)
    res["in_place"] = {"weight": key, "answer_changed": not torch.equal(before[0], changed[0]),
                       "restored_equal": bool(torch.equal(before[0], again[0]))}
    print(json.dumps(res), flush=True)
    # what load_constants does: a second package, profiled
    pkg2 = aoti.load_aoti(art_dir, index)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda"
                                                     else [])
    with torch.profiler.profile(activities=acts) as prof:
        pkg2.load_constants(mine, check_full_update=True, user_managed=True)
        sync(dev)
    res["load_constants_profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)[:3000]
    res["total_s"] = round(time.perf_counter() - T0, 3)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()

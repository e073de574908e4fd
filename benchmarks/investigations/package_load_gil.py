"""How much a busy Python thread progresses while another thread loads an AOTInductor package (session 19).

    python benchmarks/investigations/package_load_gil.py PACKAGE.pt2

The loader's head start loads the first candidate's package in a thread while laya builds its agent in the main
thread. This counts the main thread's loop iterations (a few microseconds each) during the load: few iterations
over the load's wall time mean the loading thread kept the interpreter lock, so the overlap bought nothing.
"""
import sys
import threading
import time

import torch

if __name__ == "__main__":
    path = sys.argv[1]
    done = threading.Event()
    took = {}

    def load() -> None:
        t = time.perf_counter()
        torch._C._aoti.AOTIModelPackageLoader(path, "model", True, 1, -1)
        took["load_s"] = time.perf_counter() - t
        done.set()

    t0 = time.perf_counter()
    last, gap, ticks = t0, 0.0, 0
    threading.Thread(target=load).start()
    while not done.is_set():
        now = time.perf_counter()
        gap, last, ticks = max(gap, now - last), now, ticks + 1
        sum(range(100))
    wall = time.perf_counter() - t0
    t = time.perf_counter()
    for _ in range(ticks):
        time.perf_counter()
        sum(range(100))
    alone = time.perf_counter() - t
    print("package load %.3f s; the main thread did %d iterations in %.3f s, which take %.3f s alone (%.0f%% of "
          "its speed); longest pause %.3f s" % (took["load_s"], ticks, wall, alone, 100 * alone / wall, gap))

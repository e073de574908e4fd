"""gpu_start.py's three realistic calls on the CPU, laya eager against the bundle, in one process.

    python benchmarks/cpu_calls.py CHECKPOINT BUNDLE

Median of 15 timed calls after 3 warm-ups (5 for the 32-state call). Run it twice with one LAYA_AOT_CACHE_DIR to
time the bundle as a later start leaves it (its tokenizer the snapshot the first run stored).
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_start import CALLS, states  # noqa: E402  (a sibling benchmark script)

if __name__ == "__main__":
    import laya

    import laya_aot

    ckpt, bundle = sys.argv[1], sys.argv[2]
    agents = {"eager": laya.load(ckpt, device="cpu"), "bundle": laya_aot.load(ckpt, bundle=bundle, device="cpu")}
    print("bundle: %s, tokenizer %s" % (agents["bundle"].backend, type(agents["bundle"].tok).__name__))
    for name, n, words, q in CALLS:
        st = states(n, words, 7)
        ms = {}
        for path, agent in agents.items():
            for _ in range(3):
                agent.predict_batch(st, q)
            ts = []
            for _ in range(15 if n < 32 else 5):
                t = time.perf_counter()
                agent.predict_batch(st, q)
                ts.append(time.perf_counter() - t)
            ms[path] = statistics.median(ts) * 1e3
        print("%-11s eager %8.2f ms  bundle %8.2f ms  bundle/eager %.2f" % (name, ms["eager"], ms["bundle"],
                                                                          ms["bundle"] / ms["eager"]))

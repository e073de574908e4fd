"""One start as a user's process runs it: import, load, answer one typed question, exit (nothing else timed).

    python benchmarks/start_once.py eager CHECKPOINT [DEVICE]
    python benchmarks/start_once.py bundle CHECKPOINT BUNDLE [DEVICE]

Time it from outside (`/usr/bin/time -v`, hyperfine, or any whole-process timer) to get process start to
first answer; run the two modes in turn for a ratio. A whole-process timer also counts the interpreter's exit
(0.4-0.7 s on the CPU with torch loaded): with LAYA_AOT_PRINT_FIRST_ANSWER=1 the process also prints, on stderr,
the seconds from its creation (the kernel's start time, 10 ms ticks) to its first answer; with
LAYA_AOT_LOAD_STATS_TO=FILE a bundle's start appends its `load_stats` to FILE as one JSON line, after the answer.
Both modes import the harness (standard library only) for the question they ask, so both pay it alike.
"""
import os
import sys

import harness

if __name__ == "__main__":
    mode, ckpt = sys.argv[1], sys.argv[2]
    rest = sys.argv[3:] if mode == "eager" else sys.argv[4:]
    device = rest[0] if rest else "cpu"
    if mode == "eager":
        import laya

        agent = laya.load(ckpt, device=device)
    else:
        import laya_aot

        agent = laya_aot.load(ckpt, bundle=sys.argv[3], device=device)
    agent.predict_batch([harness.STATE], harness.ONE)
    if os.environ.get("LAYA_AOT_PRINT_FIRST_ANSWER"):
        import time

        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        print("first answer %.3f s after the process started" % (time.clock_gettime(time.CLOCK_BOOTTIME) - started),
              file=sys.stderr)
    if os.environ.get("LAYA_AOT_LOAD_STATS_TO") and mode != "eager":  # after the answer: not in its time
        import json

        with open(os.environ["LAYA_AOT_LOAD_STATS_TO"], "a") as f:
            f.write(json.dumps(agent.backend_object.load_stats, default=str) + "\n")

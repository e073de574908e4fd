"""Where the time goes when a fresh process loads a CUDA AOTInductor artifact of a laya-aot bundle.

    python3 benchmarks/investigations/aoti_load_time.py BUNDLE CHECKPOINT [--name aoti-sm_90]

Prints one JSON line: import, laya.load, AOTIRunner (load_package / constants), first call, the
package's contents by file type, and what the load wrote into the Inductor cache dir. Python stacks are
dumped every 6 s to stderr and child processes are listed as they appear, so a slow load shows where
it waits (and whether it runs a compiler).
"""
from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import threading
import time
import zipfile
from collections import Counter
from pathlib import Path

T0 = time.time()


def _watch_children(seen: set) -> None:
    while True:
        out = subprocess.run(["ps", "--ppid", str(os.getpid()), "-o", "pid=,args="], capture_output=True,
                             text=True).stdout
        for line in out.splitlines():
            if line.strip() and "ps --ppid" not in line and line not in seen:
                seen.add(line)
                print("CHILD +%.1fs %s" % (time.time() - T0, line.strip()[:400]), file=sys.stderr, flush=True)
        time.sleep(0.5)


def _tree(path: str) -> dict:
    p = Path(path)
    files = [f for f in p.rglob("*") if f.is_file()] if p.exists() else []
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files),
            "by_ext": dict(Counter(f.suffix for f in files).most_common(8))}


def main() -> None:
    bundle, ckpt = sys.argv[1], sys.argv[2]
    name = sys.argv[sys.argv.index("--name") + 1] if "--name" in sys.argv else "aoti-sm_90"
    faulthandler.dump_traceback_later(6, repeat=True, file=sys.stderr)
    seen: set = set()
    threading.Thread(target=_watch_children, args=(seen,), daemon=True).start()
    import laya
    import torch

    from laya_aot.kinds.aoti import AOTIRunner
    from laya_aot.kinds.base import model_tensors

    marks = {"import_s": time.time() - T0}
    art = Path(bundle) / name
    with zipfile.ZipFile(art / "model.pt2") as z:
        infos = z.infolist()
    marks["package"] = {"files": len(infos), "by_ext": dict(Counter(Path(i.filename).suffix for i in infos)),
                        "bytes_by_ext": {e: sum(i.file_size for i in infos if Path(i.filename).suffix == e)
                                         for e in {Path(i.filename).suffix for i in infos}}}
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_%s" % os.environ.get("USER", "root"))
    marks["inductor_cache_before"] = _tree(cache)
    t = time.time()
    agent = laya.load(ckpt, device="cuda")
    marks["laya_load_s"] = time.time() - t
    t = time.time()
    runner = AOTIRunner(art, model_tensors(agent.model), "cuda")
    marks["runner_s"] = time.time() - t
    marks["runner_stats"] = runner.stats
    ids = torch.full((1, 128), 7, dtype=torch.long, device="cuda")
    batch = (ids, torch.ones_like(ids), torch.tensor([[1, 2, 3, 4]], device="cuda"),
             torch.ones((1, 4), dtype=torch.bool, device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda"))
    t = time.time()
    runner(*batch)
    torch.cuda.synchronize()
    marks["first_call_s"] = time.time() - t
    marks["inductor_cache_after"] = _tree(cache)
    marks["children"] = sorted(seen)
    marks["total_s"] = time.time() - T0
    faulthandler.cancel_dump_traceback_later()
    print("AOTI_LOAD " + json.dumps(marks), flush=True)


if __name__ == "__main__":
    main()

"""Is laya's thin agent slower beside the head start's CUDA work (session 29)?

    python benchmarks/investigations/thin_agent_gil.py CHECKPOINT alone|beside|cuda_only

A later start on the H200 spent 0.40-0.45 s in laya's thin agent (`agent_load_s`), against 0.06-0.09 s on the
2-core CPU, while the head start's thread made the CUDA context and copied the weights to the GPU. One fresh
process per mode: `alone` builds the thin agent, then does the CUDA work; `beside` does the CUDA work in a thread
while the main thread builds the thin agent (as a start does); `cuda_only` does the CUDA work alone. A large
`agent_s` beside against alone means the CUDA work holds the interpreter lock. Prints one JSON line.
"""
import json
import sys
import threading
import time

import torch

from laya_aot import checkpoint as ckpt_mod
from laya_aot import laya_internals

if __name__ == "__main__":
    ckpt, mode = sys.argv[1], sys.argv[2]
    res = {"mode": mode}

    def cuda_work() -> None:
        t = time.perf_counter()
        torch.zeros(1, device="cuda")
        res["context_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        w = ckpt_mod.Weights(ckpt)
        on_gpu = {k: w[k].to("cuda") for k in w}
        torch.cuda.synchronize()
        res["weights_s"] = round(time.perf_counter() - t, 3)
        res["tensors"] = len(on_gpu)

    t0 = time.perf_counter()
    if mode == "cuda_only":
        cuda_work()
    else:
        worker = threading.Thread(target=cuda_work) if mode == "beside" else None
        if worker is not None:
            worker.start()
        t = time.perf_counter()
        laya_internals.thin_agent(ckpt, device="cuda")
        res["agent_s"] = round(time.perf_counter() - t, 3)
        if worker is not None:
            worker.join()
        else:
            cuda_work()
    res["total_s"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(res), flush=True)

"""GPU check of kinds/graphs.py's capture (capture_begin/capture_end in thread_local mode, the allocator's caches kept):
replays equal plain calls bit for bit, several shapes share one pool, a concurrent thread's CUDA work does not break a
capture; a 1-row call replayed and plain, timed. `python benchmarks/graph_capture.py` on a GPU host (no bundle)."""
import json
import threading

import harness


def main() -> None:
    a = harness.parser(__doc__).parse_args()
    import torch

    from laya_aot.kinds.graphs import GraphedCalls

    dev = torch.device("cuda")
    torch.manual_seed(0)
    weights = [torch.randn(1024, 1024, device=dev, dtype=torch.float16) / 32 for _ in range(24)]

    def fn(ids, x):
        h = x.to(torch.float16)
        for w in weights:
            h = torch.nn.functional.layer_norm((h @ w).float(), (1024,)).to(torch.float16).relu()
        return [h.float().sum(-1), ids * 2]

    stop = threading.Event()

    def busy():  # another thread using CUDA while captures happen
        m = torch.randn(2048, 2048, device=dev)
        while not stop.is_set():
            (m @ m).sum().item()

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    graphs = GraphedCalls(fn, device=dev)
    unequal = 0
    for _ in range(4):
        for rows, tokens in [(1, 16), (2, 16), (4, 32), (8, 64), (1, 128)]:
            ids = torch.arange(rows * tokens).view(rows, tokens)
            x = torch.randn(rows, tokens, 1024)
            got = graphs(ids, x, out_device=torch.device("cpu"))
            want = [o.cpu() for o in fn(ids.to(dev), x.to(dev))]
            unequal += sum(not torch.equal(p, q) for p, q in zip(got, want))
    stop.set()
    thread.join()
    ids, x = torch.arange(16).view(1, 16), torch.randn(1, 16, 1024)
    timed = {}
    for name, call in (("replay", lambda: graphs(ids, x, out_device=torch.device("cpu"))),
                       ("plain", lambda: [o.cpu() for o in fn(ids.to(dev), x.to(dev))])):
        timed[name] = harness.median_ms(call, repeats=50, warmup=5, device="cuda")
    result = {"stats": graphs.stats, "unequal_outputs": unequal, "ms_1x16": timed}
    print(json.dumps(result))
    harness.write(a.out, "graph_capture" + a.tag, result, "```\n%s\n```" % json.dumps(result, indent=1),
                  title="CUDA graph capture")


if __name__ == "__main__":
    main()

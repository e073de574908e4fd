"""Packed rows against padded rows (`export.rows`): the same checkpoint's two bundles on the same calls.

    python benchmarks/packed_rows.py --ckpt CKPT --padded BUNDLE --packed BUNDLE [--device cuda] [--repeats 9]

Both bundles load with `laya_aot.load(prefer="aoti")` in this process. The calls: the mixed stream of
`http_load.py` (requests of 40-1,000 state tokens and 1-5 questions, each one `predict_batch` call) and merged short
calls (`--merge` of `http_load.py`'s short requests in one call, as the batcher merges them). Per stream and bundle:
the median and p95 of each request's median ms over `--repeats` rounds (the bundles alternating), the artifact's
computed cells per real token, and whether every decision equals the padded bundle's. Writes packed_rows<tag>.json
and .md to --out.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Tuple

import harness
from harness import decision


def _calls(ckpt: str, merge: int) -> Dict[str, List[Tuple[List[Any], Dict[str, Any]]]]:
    from http_load import mixed_requests, short_requests

    mixed = [([r["state"]], r["questions"]) for r in mixed_requests(ckpt)]
    short = short_requests()
    merged = [([short[(i + j) % len(short)]["state"] for j in range(merge)], short[0]["questions"])
              for i in range(len(short))]
    return {"mixed": mixed, "short x%d" % merge: merged}


def _cells(agent: Any) -> Tuple[List[int], List[int]]:
    """Record each artifact call's real and computed cells (rows x padded tokens, or the packed row)."""
    runner = agent.backend_object.runner
    seen: Tuple[List[int], List[int]] = ([], [])
    inputs = runner._inputs

    def recording(batch: Any, graphs: Any) -> Any:
        out = inputs(batch, graphs)
        seen[0].append(int(batch[1].sum()))
        seen[1].append(int(out[0].numel()))
        return out

    runner._inputs = recording
    return seen


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--padded", required=True)
    ap.add_argument("--packed", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--merge", type=int, default=6, help="short requests merged into one call")
    a = ap.parse_args()
    import laya_aot

    sync = harness.synchronizer(a.device)
    agents = {k: laya_aot.load(a.ckpt, bundle=b, device=a.device, prefer="aoti", strict=True)
              for k, b in (("padded", a.padded), ("packed", a.packed))}
    cells = {k: _cells(ag) for k, ag in agents.items()}
    res: Dict[str, Any] = {"bundles": {"padded": a.padded, "packed": a.packed}, "streams": {}}
    for stream, calls in _calls(a.ckpt, a.merge).items():
        times: Dict[str, List[List[float]]] = {k: [[] for _ in calls] for k in agents}
        answers: Dict[str, List[Any]] = {}
        for k, ag in agents.items():  # warm-up: each call's shapes (and CUDA graphs) once or twice
            for _ in range(2):
                answers[k] = [ag.predict_batch(states, qs) for states, qs in calls]
            del cells[k][0][:], cells[k][1][:]
        for _ in range(a.repeats):
            for k, ag in agents.items():
                for i, (states, qs) in enumerate(calls):
                    sync()
                    t = time.perf_counter()
                    ag.predict_batch(states, qs)
                    sync()
                    times[k][i].append(1000 * (time.perf_counter() - t))
        row = {}
        for k in agents:
            per = sorted(statistics.median(ts) for ts in times[k])
            row[k] = {"p50_ms": round(statistics.median(per), 3), "p95_ms": round(per[int(0.95 * (len(per) - 1))], 3),
                      "cells_per_real": round(sum(cells[k][1]) / max(1, sum(cells[k][0])), 3)}
        ref = [decision(ans) for call in answers["padded"] for r in call for ans in r["answers"].values()]
        got = [decision(ans) for call in answers["packed"] for r in call for ans in r["answers"].values()]
        row["decisions_equal"] = "%d / %d" % (sum(x == y for x, y in zip(ref, got)), len(ref))
        res["streams"][stream] = row
        print(stream, row, flush=True)
    lines = ["| stream | padded p50 / p95 ms | packed p50 / p95 ms | packed / padded p50 | cells per real token "
             "padded / packed | decisions equal |", "|---|---|---|---|---|---|"]
    for stream, r in res["streams"].items():
        lines.append("| %s | %.3f / %.3f | %.3f / %.3f | %.2fx | %.3f / %.3f | %s |" % (
            stream, r["padded"]["p50_ms"], r["padded"]["p95_ms"], r["packed"]["p50_ms"], r["packed"]["p95_ms"],
            r["packed"]["p50_ms"] / r["padded"]["p50_ms"], r["padded"]["cells_per_real"],
            r["packed"]["cells_per_real"], r["decisions_equal"]))
    harness.write(a.out, "packed_rows" + a.tag, res, "\n".join(lines) + "\n", title="Packed rows against padded rows")


if __name__ == "__main__":
    main()

"""The Python batcher's packing of the mixed stream (issue 59): C callers in a closed loop through `laya_aot.Batcher`
for T seconds each; requests/s, p50/p99, computed cells (rows x padded tokens) per real token and forwards per
request. The cells and forwards say how well length groups pack merged calls whatever the machine's speed.

    python benchmarks/batch_packing.py --checkpoint CKPT --bundle BUNDLE --callers 1,8,32 --seconds 10

Prints the figures and writes batch_packing<tag>.json and .md to --out.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, Tuple

import harness

sys.path.insert(0, str(harness.ROOT))


def level(batcher: Any, reqs: List[Dict[str, Any]], callers: int, seconds: float,
          calls: List[Tuple[int, int, int]]) -> Dict[str, Any]:
    """One level of http_load's in-process closed loop, with the calls it made: computed cells per real token and
    forwards per request."""
    from http_load import _callers

    calls.clear()
    lv = _callers(lambda r: batcher.submit(r["state"], r["questions"]).result(), reqs, callers, seconds)
    lv.pop("answers")
    cells, real = sum(n * t for n, t, _ in calls), sum(x for _, _, x in calls)
    return dict(lv, cells_per_real_token=round(cells / max(1, real), 3),
                forwards_per_request=round(len(calls) / max(1, lv["ok"]), 3))


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--checkpoint", required=True, help="a Laya checkpoint dir")
    p.add_argument("--bundle", required=True, help="a bundle built from --checkpoint")
    p.add_argument("--callers", default="1,8,32")
    p.add_argument("--seconds", type=float, default=10.0)
    a = p.parse_args()
    from http_load import mixed_requests

    import laya_aot
    from laya_aot.runtime.batcher import Batcher

    agent = laya_aot.load(a.checkpoint, bundle=a.bundle)
    backend = agent.backend_object
    reqs = mixed_requests(a.checkpoint)
    calls: List[Tuple[int, int, int]] = []
    forward = backend.model.forward

    def record(ids: Any, att: Any, *rest: Any, **kw: Any) -> Any:
        calls.append((ids.shape[0], ids.shape[1], int(att.sum())))
        return forward(ids, att, *rest, **kw)

    backend.model.forward = record
    with Batcher(agent) as batcher:
        out = {c: level(batcher, reqs, c, a.seconds, calls) for c in [int(x) for x in a.callers.split(",")]}
    print(json.dumps(out))
    rows = ["| callers | requests/s | p50 ms | p99 ms | computed cells per real token | forwards per request |",
            "|---|---|---|---|---|---|"] + ["| %d | %s | %s | %s | %s | %s |" % (
                c, v["rps"], v["p50_ms"], v["p99_ms"], v["cells_per_real_token"], v["forwards_per_request"])
                for c, v in out.items()]
    harness.write(a.out, "batch_packing" + a.tag, {"checkpoint": a.checkpoint, "seconds": a.seconds,
                                                   "levels": out}, "\n".join(rows) + "\n",
                  title="The Python batcher's packing of the mixed stream")
    return 0


if __name__ == "__main__":
    sys.exit(main())

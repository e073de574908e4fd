"""A service stand-in for the cache fuzz: each request is a whole `laya_aot.load` against a cache directory.

Run as `python cache_worker.py CHECKPOINT`; reads one JSON request a line on stdin ({"cache": DIR, "bundle": PATH,
"pin": sha256 or null, "prefer": kind or null, "probe": bool}, or {"eager": true} for laya's own answers) and
answers one JSON line on stdout. Unlike `worker.py`, laya's agent is made again by every load (the thin agent, its
tokenizer from the cache's snapshot or not), and what this process remembers between loads of the caches' entries
(the tokenizer snapshots it read) is forgotten first: each load sees only its cache directory, as a fresh service
process would. A cache entry that reaches native code unchecked kills this process, not pytest.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
import warnings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# a long state (laya cuts it into windows: the tokenizer's decode), a short one, one with a special token's text
STATES = ["I was charged twice for the March invoice and the refund never came " * 5, "reset my password",
          "the app crashes [MASK] when I open the billing page"]


def main(checkpoint: str) -> int:
    import laya

    import laya_aot
    from laya_aot import tokenizer_snapshot
    from laya_aot.demo import question_suite

    questions = {k: v for k, v in question_suite().items() if k in ("choice_3", "score_2", "noul_1")}

    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("eager"):
            agent = laya.load(checkpoint, device="cpu")
            print(json.dumps({"answers": [o["answers"] for o in agent.predict_batch(STATES, questions)]}), flush=True)
            continue
        os.environ["LAYA_AOT_CACHE_DIR"] = req["cache"]
        tokenizer_snapshot._LOADED.clear()   # what a fresh process would not know
        tokenizer_snapshot._REFUSED.clear()
        out = {"exc": None}
        t0 = time.perf_counter()
        try:
            agent = laya_aot.load(checkpoint, bundle=req["bundle"], device="cpu", prefer=req.get("prefer"),
                                  probe=req.get("probe", True), bundle_sha256=req.get("pin"))
            bo = agent.backend_object
            out.update(backend=agent.backend, tok=type(agent.tok).__name__,
                       probe=bo.load_stats.get("probe") if hasattr(bo, "load_stats") else None,
                       rejected=[why for _, why in getattr(bo, "rejected", [])][:4])
            out["answers"] = [o["answers"] for o in agent.predict_batch(STATES, questions)]
        except Exception as e:  # noqa: BLE001 - what the test counts: an exception escaping load() or a call
            out["exc"] = "%s: %s\n%s" % (type(e).__name__, e, traceback.format_exc()[-1500:])
        out["seconds"] = round(time.perf_counter() - t0, 3)
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

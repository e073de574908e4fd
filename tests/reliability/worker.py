"""A service stand-in for the fuzz tests: loads bundles it is told about, in its own process.

Run as `python worker.py CHECKPOINT`; reads one JSON request a line on stdin ({"bundle": DIR, "verify":
bool}) and answers one JSON line on stdout. A manifest that reaches native code unchecked kills this
process, not pytest: the test sees the death, keeps the manifest that caused it and starts a new worker.

laya's own `laya.load` runs once: later loads get the same agent (the loader installs a new backend on
it each time), so an example costs the bundle's checks, the artifact's load and the smoke check, not
a checkpoint read.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
import traceback
import warnings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(checkpoint: str) -> int:
    import laya

    import laya_aot
    from laya_aot import commands

    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    agent = laya.load(checkpoint, device="cpu")
    laya.load = lambda *a, **k: agent   # noqa: E731 - every load() and verify reuses the agent
    states = ["I was charged twice for the March invoice " * 6, "reset my password"]
    question = {"team": {"type": "choice", "instructions": "Which team?", "criteria": ["billing", "tech", "account"]}}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        out = {"load_exc": None, "inspect_internal": None, "verify_internal": None}
        try:
            a = laya_aot.load(checkpoint, bundle=req["bundle"], device="cpu", probe=req.get("probe", False),
                              prefer=req.get("prefer"))
            out["backend"] = a.backend
            out["reasons"] = [why for _, why in getattr(a.backend_object, "rejected", [])]
            # real traffic through whatever was installed, at a length near the context
            a.predict_batch(states, question)
        except Exception as e:  # noqa: BLE001 - what the test counts: an exception escaping load(strict=False)
            out["load_exc"] = "%s: %s\n%s" % (type(e).__name__, e, traceback.format_exc()[-1500:])
        for name, argv in (("inspect", [req["bundle"], "--json"]),
                           ("verify", [req["bundle"], "--checkpoint", checkpoint, "--seed", "1"])):
            if name == "verify" and not req.get("verify"):
                continue
            err, std = io.StringIO(), io.StringIO()
            try:
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
                    rc = getattr(commands, name)(argv, 0.0)
                text = err.getvalue() + std.getvalue()
                if "internal error" in text or "Traceback" in text or rc not in (0, 1, 2):
                    out[name + "_internal"] = "rc %s: %s" % (rc, text[-1500:])
            except BaseException as e:  # noqa: BLE001 - an exception escaping the command
                out[name + "_internal"] = "%s: %s\n%s" % (type(e).__name__, e, traceback.format_exc()[-1500:])
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

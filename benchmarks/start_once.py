"""One start as a user's process runs it: import, load, answer one typed question, exit (nothing else timed).

    python benchmarks/start_once.py eager CHECKPOINT
    python benchmarks/start_once.py bundle CHECKPOINT BUNDLE [DEVICE]

Time it from outside (`/usr/bin/time -v`, hyperfine, or any whole-process timer) to get process start to
first answer; run the two modes in turn for a ratio.
"""
import sys

QUESTION = {"team": {"type": "choice", "instructions": "Which team should handle this?",
                     "criteria": {"billing": "payments, refunds", "technical": "errors, outages", "account": "login"}}}

if __name__ == "__main__":
    mode, ckpt = sys.argv[1], sys.argv[2]
    device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    if mode == "eager":
        import laya

        agent = laya.load(ckpt, device=device)
    else:
        import laya_aot

        agent = laya_aot.load(ckpt, bundle=sys.argv[3], device=device)
    agent.predict_batch(["I was charged twice for the March invoice"], QUESTION)

"""The head at the answer rows against the full head, decision by decision, on one machine (session 20).

    python benchmarks/investigations/head_decisions.py CHECKPOINT [--dtype bf16] [--n 2048]

Runs the build's seeded decision suite (`verification.decision_cases`) through laya's fp32 forward (the
reference), laya's eager forward under autocast in `--dtype`, and the export module (`ExplicitDtypeModel`) in that
dtype with `export.head=full` and with `export.head=answer_rows`; prints each one's agreement with fp32's decisions
and the one-sided McNemar statement of each head against laya eager (`tolerance.decision_statement`), and the
decisions where the two heads differ. Eager PyTorch on this machine's device: the maths of the two heads, not
Inductor's kernels.
"""
import argparse
import json

import torch

if __name__ == "__main__":
    from pathlib import Path

    import laya

    from laya_aot import laya_internals as laya_api
    from laya_aot.checkpoint import describe
    from laya_aot.config import CheckpointConfig
    from laya_aot.dtypes import torch_dtype
    from laya_aot.model import ExplicitDtypeModel
    from laya_aot.padding import Ranges
    from laya_aot.tolerance import decision_statement
    from laya_aot.verification import _decisions, decision_cases

    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    agent = laya.load(a.checkpoint, device="cpu")
    model = agent.model.eval().float()
    context = int(describe(Path(a.checkpoint), CheckpointConfig(path=a.checkpoint))["max_len"])
    ranges = Ranges(1, 64, 32, context, 2, 64)
    suite = decision_cases(a.seed, ranges, laya_api.vocab(agent), laya_api.pad_id(agent), context, a.n)
    dt = torch_dtype(a.dtype)
    heads = {h: ExplicitDtypeModel(model, dt, torch.float32, "cpu", head=h) for h in ("full", "answer_rows")}

    def run(fn):
        with torch.no_grad():
            return torch.cat([_decisions(fn(*c.batch)[0], c.batch) for c in suite])

    ref = run(model)
    with torch.autocast("cpu", dtype=dt):
        eager = run(model)
    got = {h: run(m) for h, m in heads.items()}
    out = {"checkpoint": a.checkpoint, "dtype": a.dtype, "decisions": int(ref.numel()),
           "eager_agrees": round(float((eager == ref).float().mean()) * 100, 3)}
    for h, d in got.items():
        st = decision_statement((d == ref).tolist(), (eager == ref).tolist(), 0.01)
        out[h] = {"agrees": round(float((d == ref).float().mean()) * 100, 3), "statement": str(st)}
    out["heads_differ_on"] = int((got["full"] != got["answer_rows"]).sum())
    out["only_full_right"] = int(((got["full"] == ref) & (got["answer_rows"] != ref)).sum())
    out["only_answer_rows_right"] = int(((got["answer_rows"] == ref) & (got["full"] != ref)).sum())
    print(json.dumps(out, indent=1))

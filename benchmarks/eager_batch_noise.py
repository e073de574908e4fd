"""How much laya's own eager forward depends on what else is in the batch (GPU, laya's serving dtype).

    python3 benchmarks/eager_batch_noise.py [--names a,b,...]

The near-tie guard (`near_ties="rows"`, runtime/backend.py) recomputes a near-tie row with laya's eager forward
on a batch of only the near-tie rows. That is laya's own arithmetic, but not on the same batch that laya would have
run, and 16-bit GPU kernels may round a row differently when the batch around it changes (another
matmul shape, another kernel). This measures that floor for the matrix checkpoints of gpu_matrix.py
(same seeds, states and questions), inside laya's own `predict_batch` (so under its autocast):

- the same batch run twice: bitwise equal or not;
- each row alone, and the near-tie rows together (as the guard runs them): the largest option-probability
  difference from the full batch, and the rows whose top option changes, with their full-batch gap;
- at the answer level: each state alone and each question alone against the 3-state call;
- laya eager's `predict_batch` time for the 3 states x 60 questions (median of 5).

Writes eager_batch_noise<tag>.json/.md to --out.
"""
from __future__ import annotations

import json
from pathlib import Path

import harness
from gpu_matrix import DEFAULT  # the same checkpoints


def measure(name: str, work: Path, guard_margin: float, device: str = "cuda") -> dict:
    import laya
    import numpy as np
    import torch

    from laya_aot.demo import make_checkpoint, question_suite, state_text
    from laya_aot.laya_internals import serving_dtype
    from laya_aot.padding import option_probs

    ckpt = make_checkpoint(work / name, name, seed=7)
    agent = laya.load(str(ckpt), device=device)
    qs = question_suite()
    rng = np.random.default_rng(11)
    states = [state_text(rng, n) for n in (5, 40, 160)]
    agent.predict_batch(states, qs)  # warm-up
    orig = agent.model.forward
    rec: dict = {}

    def probe(input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder=False, **extra):
        out = orig(input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder, **extra)
        if rec or extra:
            return out
        args = (input_ids, attention_mask, marker_pos, marker_mask, qtype)
        k = out[0].shape[1]
        multi = marker_mask[:, :k].sum(-1) >= 2
        full = option_probs(out[0], k)
        again = orig(*args, detach_encoder)
        rec["rows"], rec["tokens"] = int(input_ids.shape[0]), int(input_ids.shape[1])
        rec["same_batch_again_bitwise_equal"] = bool(torch.equal(again[0], out[0]) and torch.equal(again[1], out[1]))
        top2 = full.topk(2, -1).values
        gap = (top2[:, 0] - top2[:, 1]).float()

        def compare(rows: torch.Tensor, sub_logits: torch.Tensor) -> dict:
            sub = option_probs(sub_logits, k)
            diff = (sub - full[rows]).abs().max(-1).values
            flips = [int(r) for r, s, f in zip(rows.tolist(), sub.argmax(-1).tolist(), full[rows].argmax(-1).tolist())
                     if s != f and bool(multi[r])]
            bitwise = int(sum(bool(torch.equal(sub_logits[i], out[0][r])) for i, r in enumerate(rows.tolist())))
            return {"rows": int(rows.numel()), "bitwise_equal_rows": bitwise,
                    "max_option_prob_diff": float(diff.max()) if rows.numel() else 0.0,
                    "top_option_changed": [{"row": r, "full_batch_gap": round(float(gap[r]), 6)} for r in flips]}

        singles = torch.cat([orig(*(x[r:r + 1] for x in args), detach_encoder)[0][:, :k]
                             for r in range(input_ids.shape[0])])
        rec["each_row_alone"] = compare(torch.arange(input_ids.shape[0], device=input_ids.device), singles)
        near = torch.nonzero(multi & (gap <= guard_margin)).flatten()
        if near.numel():
            rec["near_tie_rows_together"] = compare(near, orig(*(x[near] for x in args), detach_encoder)[0][:, :k])
        return out

    agent.model.forward = probe
    try:
        full = agent.predict_batch(states, qs)
    finally:
        agent.model.forward = orig
    per_state = [agent.predict_batch([s], qs)[0] for s in states]
    per_question = [{q: agent.predict_batch([s], {q: qs[q]})[0]["answers"][q] for q in qs} for s in states]
    answers = {}
    alone = (("each_state_alone", [p["answers"] for p in per_state]), ("each_question_alone", per_question))
    for label, other in alone:
        differ = [{"state": i, "question": q, "type": f["answers"][q]["type"]}
                  for i, (f, o) in enumerate(zip(full, other)) for q in qs
                  if harness.decision(f["answers"][q]) != harness.decision(o[q])]
        answers[label] = {"decisions": len(states) * len(qs), "differ": differ}
    return {"serves": serving_dtype(agent), "forward": rec, "answers": answers,
            "eager_predict_batch_ms": round(harness.predict_ms(agent, states, qs, 5, 0, device)[0], 2)}


def markdown(report: dict) -> str:
    lines = ["| checkpoint | laya serves | rows x tokens | same batch twice bitwise | each row alone: bitwise rows, "
             "max dp, top option changed (full-batch gap) | near-tie rows together: same | decisions differing: "
             "state alone / question alone | eager predict_batch ms |",
             "|---|---|---|---|---|---|---|---|"]

    def cell(c):
        if not c:
            return "-"
        ch = ", ".join("%.2g" % x["full_batch_gap"] for x in c["top_option_changed"]) or "none"
        return "%d/%d, %.3g, %s" % (c["bitwise_equal_rows"], c["rows"], c["max_option_prob_diff"], ch)

    for n, r in report["checkpoints"].items():
        if "error" in r:
            lines.append("| %s | error: %s |" % (n, r["error"]))
            continue
        f, a = r["forward"], r["answers"]
        lines.append("| %s | %s | %d x %d | %s | %s | %s | %d / %d of %d | %s |" % (
            n, r["serves"], f["rows"], f["tokens"], f["same_batch_again_bitwise_equal"], cell(f["each_row_alone"]),
            cell(f.get("near_tie_rows_together")), len(a["each_state_alone"]["differ"]),
            len(a["each_question_alone"]["differ"]), a["each_state_alone"]["decisions"], r["eager_predict_batch_ms"]))
    return "\n".join(lines) + "\n"


def main() -> int:
    p = harness.parser(__doc__, work=True)
    p.add_argument("--names", default=",".join(DEFAULT))
    p.add_argument("--guard-margin", type=float, default=0.01, help="full-batch gap of the rows rerun together")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    report = {"environment": harness.environment(), "checkpoints": {}}
    for n in a.names.split(","):
        try:
            report["checkpoints"][n] = measure(n, Path(a.work), a.guard_margin, a.device)
        except Exception as e:  # one checkpoint's failure is a row of the report, not the end of it
            report["checkpoints"][n] = {"error": "%s: %s" % (type(e).__name__, e)}
        print(n, json.dumps(report["checkpoints"][n])[:600], flush=True)
    harness.write(a.out, "eager_batch_noise" + a.tag, report, markdown(report),
                  title="How much laya's eager forward depends on its batch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

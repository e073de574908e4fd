"""Checkpoints of shapes nobody chose, built and served on the CPU, each answer compared with laya eager's.

    python benchmarks/config_fuzz.py --n 12 --seed 0 [--aoti-every 3]

Each case draws a `DemoShape` at random (hidden size and heads with head dims 8-48, 1-4 layers, every-n global
attention, local windows 2-96, 1-3 head layers, 1-8 actions, max_len 32-300, BPE or WordPiece, fp16 / bf16 /
absent amp_dtype), makes the checkpoint with laya's own writer, builds a bundle (the exported program and ONNX;
every `--aoti-every`-th case the default CPU build with AOTInductor too), loads it with `laya_aot.load` and laya
eager with `laya.load`, and asks both the 60-question suite plus four questions of 8-16 options on states of
3-400 words (past max_len included: laya truncates), in batches of 1-7 states (`batch_size` None or 1-3). A case
passes when the bundle serves (not laya's eager forward) and every answer equals laya eager's (the tests' rule:
same decision, probabilities within 1e-4 as laya rounds them), and every input laya refuses is refused with the
same error. Checkpoints and bundles go under --work; writes config_fuzz<tag>.json and .md (per case the shape,
what served, and each difference found) to --out, after every case.
"""
from __future__ import annotations

import json
import random
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import harness

sys.path.insert(0, str(harness.ROOT))  # tests.questions: the tests' rule for equal answers


def draw(rng: random.Random):
    from laya_aot.demo import DemoShape

    head_dim = rng.choice([8, 16, 24, 32, 48])
    heads = rng.choice([1, 2, 3, 4])
    return DemoShape(
        hidden_size=head_dim * heads, num_attention_heads=heads, num_hidden_layers=rng.randint(1, 4),
        intermediate_size=rng.choice([32, 48, 96, 160]), vocab_size=rng.choice([1300, 1536, 2048]),
        max_len=rng.choice([32, 64, 128, 200, 300]), head_layers=rng.randint(1, 3), n_actions=rng.randint(1, 8),
        local_attention=rng.choice([2, 8, 16, 64, 96]), global_attn_every_n_layers=rng.randint(1, 3),
        amp_dtype=rng.choice([None, "fp16", "bf16"]), tokenizer_vocab=rng.choice([600, 1000, 1200]),
        tokenizer=rng.choice(["bpe", "wordpiece"]), head_gain=rng.choice([1.0, 3.0, 8.0]))


def differences(got, ref, tol=1e-4 + 1e-12):
    """The rule of tests/questions.assert_same_answers, as a list of what differs."""
    from tests.questions import _answer_key

    out = []
    for qid, r in ref.items():
        g = got.get(qid)
        if g is None:
            out.append("%s: missing" % qid)
            continue
        if _answer_key(g) != _answer_key(r):
            out.append("%s: decision %r vs %r" % (qid, _answer_key(g), _answer_key(r)))
        for k, v in (r.get("probabilities") or {}).items():
            if abs(g["probabilities"][k] - v) > tol:
                out.append("%s: p[%s] %.4f vs %.4f" % (qid, k, g["probabilities"][k], v))
        if r["type"] == "noul" and abs(g["noul"] - r["noul"]) > tol:
            out.append("%s: noul %.4f vs %.4f" % (qid, g["noul"], r["noul"]))
        if abs(g["action"]["act_probability"] - r["action"]["act_probability"]) > tol:
            out.append("%s: act %.4f vs %.4f" % (qid, g["action"]["act_probability"], r["action"]["act_probability"]))
    return out


def _answer(agent, states, questions, batch_size):
    """`predict_batch`'s answers, or the error it raised as 'Type: message' (laya's refusal of the input)."""
    try:
        return agent.predict_batch(states, questions, batch_size)
    except (ValueError, TypeError) as e:
        return "%s: %s" % (type(e).__name__, e)


def case(i: int, shape, root: Path, aoti: bool, rng: random.Random) -> dict:
    import laya
    import numpy as np

    import laya_aot
    from laya_aot.config import compose
    from laya_aot.demo import make_checkpoint, question_suite, state_text
    from laya_aot.pipeline import build

    out = {"case": i, "shape": asdict(shape), "aoti": aoti}
    ckpt = make_checkpoint(root / ("ck%d" % i), shape, seed=i)
    overrides = ["checkpoint.path=%s" % ckpt, "output_dir=%s" % (root / ("b%d" % i)), "verify.tolerance.decisions=256"]
    if not aoti:
        overrides += ["stages.aoti=false", "stages.inductor_cache=false"]
    t = time.perf_counter()
    built = build(compose(overrides)).bundle
    out["build_s"] = round(time.perf_counter() - t, 1)
    out["artifacts"] = {a.name: a.status for a in built.artifacts}
    agent = laya_aot.load(ckpt, bundle=root / ("b%d" % i), device="cpu")
    out["served_by"] = agent.backend
    eager = laya.load(str(ckpt), device="cpu")
    qs = question_suite()
    wide = np.random.default_rng(100 + i)
    for j, n in enumerate((8, 12, 16)):  # more options than the suite's six: more marker columns
        qs["wide_choice_%d" % j] = {"type": "choice", "instructions": "Which fits? %s" % state_text(wide, 3),
                                    "criteria": {"o%d" % k: state_text(wide, 2) for k in range(n)}}
    qs["wide_score"] = {"type": "score", "instructions": "Rate: %s" % state_text(wide, 3),
                        "criteria": [state_text(wide, 2) for _ in range(10)]}
    srng = np.random.default_rng(i)
    found, asked = [], 0
    names = list(qs)
    for _ in range(6):
        states = [state_text(srng, int(srng.choice([3, 20, 60, 150, 400]))) for _ in range(rng.randint(1, 7))]
        pick = {k: qs[k] for k in rng.sample(names, rng.randint(1, 12))}
        size = rng.choice([None, None, 1, 2, 3])  # laya's batch_size: its windows of states
        got, ref = _answer(agent, states, pick, size), _answer(eager, states, pick, size)
        if isinstance(ref, str) or isinstance(got, str):  # laya refused the input: the bundle must refuse it alike
            if got == ref:
                out.setdefault("refused_alike", []).append(ref)
            else:
                found.append("%s vs %s" % (got, ref))
            continue
        for g, r in zip(got, ref):
            asked += len(r["answers"])
            found += differences(g["answers"], r["answers"])
    out["answers_compared"] = asked
    out["differences"] = found[:20]
    out["n_differences"] = len(found)
    out["backend_stats"] = {k: v for k, v in getattr(agent.backend_object, "stats", {}).items()
                            if isinstance(v, (int, float, str))}
    return out


def markdown(doc: dict) -> str:
    cases = doc["cases"]
    served = [c for c in cases if str(c.get("served_by", "")).startswith("aot:")]
    lines = ["%d cases: %d served from an artifact, %d answers compared, %d differences, %d errors." % (
        len(cases), len(served), sum(c.get("answers_compared", 0) for c in cases),
        sum(c.get("n_differences", 0) for c in cases), sum(1 for c in cases if "error" in c)), "",
             "| case | served by | answers compared | differences | refused alike | error |",
             "|---|---|---|---|---|---|"]
    for c in cases:
        lines.append("| %s | %s | %s | %s | %s | %s |" % (
            c["case"], c.get("served_by", "-"), c.get("answers_compared", "-"), c.get("n_differences", "-"),
            len(c.get("refused_alike", [])), (c.get("error") or "")[:200].replace("|", "/")))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = harness.parser(__doc__, work=True)
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--aoti-every", type=int, default=3)
    a = ap.parse_args()
    root = a.work
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    doc = {"environment": harness.environment(), "cases": []}
    for i in range(a.n):
        shape = draw(rng)
        try:
            r = case(i, shape, root, a.aoti_every > 0 and i % a.aoti_every == 0, rng)
        except Exception as e:  # noqa: BLE001 - a case that fails is a finding, recorded with its traceback
            r = {"case": i, "shape": asdict(shape), "error": "%s: %s" % (type(e).__name__, e),
                 "traceback": traceback.format_exc()[-3000:]}
        doc["cases"].append(r)
        print(json.dumps({k: r.get(k) for k in ("case", "served_by", "answers_compared", "n_differences", "error",
                                                  "build_s")}), flush=True)
        harness.write(a.out, "config_fuzz" + a.tag, doc, partial=True)
    harness.write(a.out, "config_fuzz" + a.tag, doc, markdown(doc),
                  title="Checkpoints of drawn shapes, served on the CPU beside laya eager")


if __name__ == "__main__":
    main()

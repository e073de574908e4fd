"""How far a demo checkpoint's own bf16 forward is from its fp32 forward, on the verification cases.

    python benchmarks/investigations/bf16_scale_check.py large-1024 [--head-gain 2.0] [--out FILE.json]

Any bf16 artifact (and laya's own bf16 paths) inherits this difference, so a random checkpoint whose
bf16 forward already exceeds the bf16 tolerance would fail every bf16 artifact's verification. Runs on
the CPU: the eager model cast to bf16 against the same model in fp32, with `laya_aot.verification`.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    import laya

    from laya_aot.demo import demo_shape, make_checkpoint
    from laya_aot.model import ExplicitDtypeModel
    from laya_aot.padding import Ranges
    from laya_aot.tolerance import Rule
    from laya_aot.verification import cases, verify_runner

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape")
    ap.add_argument("--head-gain", type=float, default=None, help="override the preset's head gain")
    ap.add_argument("--max-rows", type=int, default=8)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    overrides = {} if a.head_gain is None else {"head_gain": a.head_gain}
    spec = demo_shape(a.shape, **overrides)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "ckpt", spec)
        agent = laya.load(str(ckpt), device="cpu")
        ref = agent.model.float().eval()
        bf16 = ExplicitDtypeModel(ref, torch.bfloat16, torch.float32)
        pad = int(agent.tok.pad_token_id or 0)
        vocab = min(int(ref.encoder.config.vocab_size), len(agent.tok))
        r = Ranges(1, a.max_rows, 16, int(agent.cfg.get("max_len", 512)), 2, 64)
        case_list = cases(0, r, vocab, pad)
        t0 = time.time()
        res = verify_runner(lambda *b: bf16(*b), ref, case_list, r, pad, torch.device("cpu"), Rule(2e-2, 0.95, "the fixed bf16 bound this investigation used"))
        with torch.no_grad():
            _, act = ref(*case_list[1].batch)
        spread = torch.softmax(act.float(), -1).max(-1).values.mean().item()
    out = {"shape": a.shape, "head_gain": spec.head_gain, "layer_gain": spec.layer_gain,
           "passes_bf16_tolerance_2e-2": res.passed, "max_abs_option_prob": res.max_abs_option_prob,
           "max_abs_action_prob": res.max_abs_action_prob, "argmax_agreement": res.argmax_agreement,
           "mean_top_action_prob_many_rows": spread, "seconds": round(time.time() - t0, 1),
           "per_case": {k: [v["max_abs_option_prob"], v["max_abs_action_prob"]] for k, v in res.cases.items()}}
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

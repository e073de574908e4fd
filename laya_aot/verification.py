"""Every artifact against laya's eager fp32 forward, on fresh seeded inputs: what build and runtime share.

The reference runs the batch exactly as laya's Agent collates it (tokens padded only to the batch's
longest row, one marker column for a one-option question); the artifact runs the same batch padded
the way the runtime pads it (`laya_aot.padding`). Compared per row: the option probabilities, the
action probabilities, and whether the top option agrees. The cases cover one row, many rows, a
one-option question, the widest marker count, token counts that are not multiples of 16, laya's
padding rows (`laya.backends.base.pad_batch`) and the longest context. What passes is decided by
`tolerance.rule_for`; the smoke record is the one seeded batch the loader re-checks at start-up.
`verify_artifact` (against a `reference`) is the one verification the build, `laya-aot verify` and the loader run.
"""
from __future__ import annotations

import copy
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import progress
from .dtypes import torch_dtype
from .manifest import SmokeRecord, VerifyResult
from .padding import Ranges, action_probs, chunks, for_runner, option_probs, pad_batch
from .tolerance import Agreement, DecisionAgreement, Rule, Tolerance, decision_statement, rule_for

log = logging.getLogger(__name__)

Batch = Tuple[torch.Tensor, ...]


@dataclass
class Case:
    name: str
    batch: Batch
    # rows at the end that are padding (laya's pad_batch), excluded from the comparison
    pad_rows: int = 0


def random_rows(g: torch.Generator, lengths: List[int], markers: List[int], vocab: int, pad_id: int) -> Batch:
    n, t, k = len(lengths), max(lengths), max(markers)
    ids = torch.full((n, t), pad_id, dtype=torch.long)
    att = torch.zeros((n, t), dtype=torch.long)
    mpos = torch.zeros((n, k), dtype=torch.long)
    mmask = torch.zeros((n, k), dtype=torch.bool)
    for i, (length, m) in enumerate(zip(lengths, markers)):
        ids[i, :length] = torch.randint(5, vocab, (length,), generator=g)
        att[i, :length] = 1
        # markers sit inside the row's own tokens, in increasing order, as build_sequence places them
        mpos[i, :m] = torch.sort(torch.randperm(length - 2, generator=g)[:m] + 1).values
        mmask[i, :m] = True
    qtype = torch.randint(0, 3, (n,), generator=g)
    return ids, att, mpos, mmask, qtype


def cases(seed: int, ranges: Ranges, vocab: int, pad_id: int, context: Optional[int] = None) -> List[Case]:
    """Fresh seeded inputs of several shapes inside the artifact's ranges and, when given, the checkpoint's
    context: laya never sends a longer row, and a manifest's ranges must not decide how much memory this takes."""
    from .laya_internals import pad_batch as laya_pad_batch

    g = torch.Generator().manual_seed(seed)
    tmax, kmax = min(ranges.max_tokens, context or ranges.max_tokens), ranges.max_markers

    def r(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    def odd(hi: int) -> int:
        """An odd count (never a multiple of 16) of 20 to about `hi` tokens, never past the context: r(20, 64) | 1
        was 65 for a context of 64 tokens. The draws of every context it fitted are the ones they always were."""
        n = r(min(20, hi), hi) | 1
        return n if n <= tmax else n - 2

    out = [
        Case("one_row", random_rows(g, [odd(min(tmax, 120))], [4], vocab, pad_id)),
        Case("many_rows", random_rows(g, [odd(min(tmax, 200)) for _ in range(8)], [r(2, 6) for _ in range(8)],
                                vocab, pad_id)),
        Case("one_option", random_rows(g, [odd(min(tmax, 90)) for _ in range(3)], [1, 1, 1], vocab, pad_id)),
        Case("max_markers", random_rows(g, [tmax - 3, tmax // 2 + 1], [min(kmax, tmax - 8), 3], vocab, pad_id)),
        Case("odd_tokens", random_rows(g, [min(t, tmax) for t in (17, 33, 45)], [2, 3, 2], vocab, pad_id)),
        Case("longest", random_rows(g, [tmax, tmax - 16], [3, 5], vocab, pad_id)),
        Case("max_rows", random_rows(g, [min(r(24, 40), tmax) for _ in range(ranges.max_rows)], [3] * ranges.max_rows,
                               vocab, pad_id)),
    ]
    real = random_rows(g, [odd(min(tmax, 100)) for _ in range(3)], [3, 2, 4], vocab, pad_id)
    ids, att, mpos, mmask, qtype, n, _ = laya_pad_batch(*real, max_len=tmax, pad_id=pad_id, keep_one_token=True)
    out.append(Case("padding_rows", (ids, att, mpos, mmask, qtype), pad_rows=ids.shape[0] - n))
    return out


SMOKE_SEED = 11


def smoke_batch(ranges: Ranges, vocab: int, pad_id: int) -> Batch:
    """The seeded batch the runtime runs before it trusts an artifact: two rows of odd lengths, 3 and 2 options."""
    g = torch.Generator().manual_seed(SMOKE_SEED)
    tokens = min(ranges.max_tokens, 45)
    return random_rows(g, [tokens, tokens - 7], [3, 2], vocab, pad_id)


def smoke_record(reference_model: torch.nn.Module, ranges: Ranges, vocab: int, pad_id: int) -> SmokeRecord:
    """The smoke batch and the eager fp32 forward's outputs on it, for the manifest: the runtime then
    checks a loaded artifact against the build's reference without running the eager model itself."""
    batch = smoke_batch(ranges, vocab, pad_id)
    ref = reference_outputs(reference_model, [Case("smoke", batch)])["smoke"]
    return SmokeRecord(inputs=[t.tolist() for t in batch], input_dtypes=[str(t.dtype).split(".")[-1] for t in batch],
                       reference=[t.float().tolist() for t in ref])


def smoke_from_record(record: SmokeRecord) -> Tuple[Batch, Tuple[torch.Tensor, torch.Tensor]]:
    """The batch and reference outputs stored by `smoke_record`."""
    batch = tuple(torch.tensor(x, dtype=getattr(torch, d)) for x, d in zip(record.inputs, record.input_dtypes))
    logits, act = (torch.tensor(x, dtype=torch.float32) for x in record.reference)
    return batch, (logits, act)


def run_padded(runner: Callable[..., Tuple[torch.Tensor, torch.Tensor]], batch: Batch, ranges: Ranges,
               pad_id: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Run an artifact the way the runtime does: pad, split rows into chunks, pad a chunk its CUDA graphs replay
    to its stepped shape (`padding.for_runner`), concatenate each chunk's own rows."""
    padded = pad_batch(batch, ranges, pad_id)
    outs = []
    for s in chunks(padded[0].shape[0], ranges, padded[0].shape[1]):
        piece = for_runner(tuple(t[s] for t in padded), runner, ranges, pad_id)
        lo, ac = runner(*(t.to(device) for t in piece))
        outs.append((lo[:s.stop - s.start], ac[:s.stop - s.start]))
    return torch.cat([o[0].float().cpu() for o in outs]), torch.cat([o[1].float().cpu() for o in outs])


def compare(reference: Tuple[torch.Tensor, torch.Tensor], candidate: Tuple[torch.Tensor, torch.Tensor], batch: Batch,
            pad_rows: int) -> Dict[str, float]:
    """Per-row agreement of two forwards' outputs on `batch`, ignoring laya's `pad_rows` at the end."""
    n_rows = batch[0].shape[0] - pad_rows
    k = batch[2].shape[1]
    p_ref, p_got = option_probs(reference[0][:n_rows], k), option_probs(candidate[0][:n_rows], k)
    a_ref, a_got = action_probs(reference[1][:n_rows]), action_probs(candidate[1][:n_rows])
    finite = bool(torch.isfinite(p_got).all() and torch.isfinite(a_got).all())
    return {
        "rows": n_rows,
        "max_abs_option_prob": float((p_ref - p_got).abs().max()) if finite else float("inf"),
        "max_abs_action_prob": float((a_ref - a_got).abs().max()) if finite else float("inf"),
        "argmax_agree": int((p_ref.argmax(-1) == p_got.argmax(-1)).sum()),
    }


def reference_outputs(reference_model: torch.nn.Module, case_list: List[Case]) -> Dict[str, Batch]:
    """The eager forward of every case, on the CPU: computed once and shared by all artifacts."""
    ref_device = next(reference_model.parameters()).device
    with torch.no_grad():
        return {case.name: tuple(t.cpu() for t in reference_model(*(x.to(ref_device) for x in case.batch)))
                for case in case_list}


def _agreement(per_case: Dict[str, Dict[str, float]]) -> Agreement:
    rows = sum(c["rows"] for c in per_case.values())
    return Agreement(max_abs_option_prob=max(c["max_abs_option_prob"] for c in per_case.values()),
                     max_abs_action_prob=max(c["max_abs_action_prob"] for c in per_case.values()),
                     argmax_agreement=sum(c["argmax_agree"] for c in per_case.values()) / max(1, rows))


def eager_in_dtype(model: torch.nn.Module, dtype: str, case_list: List[Case],
                   references: Dict[str, Batch]) -> Agreement:
    """How far laya's own eager forward in `dtype` is from fp32 on the cases: the fp32 model run under
    autocast, as laya's Agent runs it (on `model`'s device, so a CUDA artifact is measured against CUDA)."""
    device = next(model.parameters()).device
    per_case = {}
    with torch.no_grad(), torch.autocast(device.type, dtype=torch_dtype(dtype)):
        for case in case_list:
            logits, act = model(*(x.to(device) for x in case.batch))
            ref = references[case.name]
            per_case[case.name] = compare((ref[0].float(), ref[1].float()), (logits.float().cpu(), act.float().cpu()),
                                          case.batch, case.pad_rows)
    return _agreement(per_case)


def decision_cases(seed: int, ranges: Ranges, vocab: int, pad_id: int, context: Optional[int], n: int) -> List[Case]:
    """The seeded decision suite: `n` rows of two to six options each (every row a decision), in calls of 1, 8
    and 32 rows (at most the export's) and short (16-64 tokens), medium (64-256) and long (256 to the context)
    states, all three question types."""
    g = torch.Generator().manual_seed(seed)
    tmax, kmax = min(ranges.max_tokens, context or ranges.max_tokens), min(6, ranges.max_markers)
    regimes = ((16, 64), (64, 256), (256, tmax))

    def r(lo: int, hi: int) -> int:
        return int(torch.randint(lo, max(lo, hi) + 1, (1,), generator=g))

    out: List[Case] = []
    done = 0
    while done < n:
        i = len(out)
        rows = min(n - done, (1, 8, 32)[i % 3], ranges.max_rows)
        lo, hi = regimes[(i // 3) % 3]
        lo, hi = min(lo, tmax), min(hi, tmax)
        lengths = [r(max(lo, kmax + 3), hi) for _ in range(rows)]
        out.append(Case("decisions_%d" % i, random_rows(g, lengths, [r(2, kmax) for _ in range(rows)], vocab, pad_id)))
        done += rows
    return out


def _decisions(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The top option of every row (all rows of the decision suite have two options or more)."""
    return option_probs(logits.float().cpu(), batch[2].shape[1]).argmax(-1)


class EagerFigures:
    """laya's eager forward in each 16-bit dtype on one set of cases (and, given one, on the decision suite),
    per device: computed once each, shared by every artifact of that dtype."""

    def __init__(self, model: torch.nn.Module, case_list: List[Case], references: Dict[str, Batch],
                 suite: Optional[List[Case]] = None, alpha: float = 0.01):
        self._model, self._cases, self._refs = model, case_list, references
        self._done: Dict[Tuple[str, str], Agreement] = {}
        self._suite, self._alpha = suite or [], alpha
        self._suite_ref: Dict[str, List[torch.Tensor]] = {}
        self._suite_eager: Dict[Tuple[str, str], List[torch.Tensor]] = {}
        self._models: Dict[str, torch.nn.Module] = {}

    def _on(self, device: str) -> torch.nn.Module:
        """The model on `device` (one copy per device)."""
        here = next(self._model.parameters()).device
        if torch.device(device) == here:
            return self._model
        if device not in self._models:
            self._models[device] = copy.deepcopy(self._model).to(device)
        return self._models[device]

    def decisions(self, runner, dtype: str, ranges: Ranges, pad_id: int) -> Optional[DecisionAgreement]:
        """The artifact's decisions on the suite against fp32's, paired with laya eager's in `dtype` on the
        artifact's device (None for fp32, which laya serves as the reference itself, or without a suite)."""
        if dtype == "fp32" or not self._suite:
            return None
        device = str(runner.device)
        model = self._on(device)  # fp32 on the artifact's device too: a GPU build's CPU reference would take minutes
        with torch.no_grad():
            if device not in self._suite_ref:
                with torch.autocast(torch.device(device).type, enabled=False):
                    self._suite_ref[device] = [_decisions(model(*(x.to(device) for x in c.batch))[0], c.batch)
                                               for c in self._suite]
            if (device, dtype) not in self._suite_eager:
                with torch.autocast(torch.device(device).type, dtype=torch_dtype(dtype)):
                    self._suite_eager[(device, dtype)] = [
                        _decisions(model(*(x.to(device) for x in c.batch))[0], c.batch) for c in self._suite]
            got = [_decisions(run_padded(runner, c.batch, ranges, pad_id, runner.device)[0], c.batch)
                   for c in self._suite]
        ref, eager = torch.cat(self._suite_ref[device]), torch.cat(self._suite_eager[(device, dtype)])
        return decision_statement((torch.cat(got) == ref).tolist(), (eager == ref).tolist(), self._alpha)

    def get(self, dtype: str, device: str) -> Optional[Agreement]:
        """None for fp32 (its rule needs no eager figures)."""
        if dtype == "fp32":
            return None
        key = (str(device), dtype)
        if key not in self._done:
            self._done[key] = eager_in_dtype(self._on(device), dtype, self._cases, self._refs)
        return self._done[key]


def verify_runner(runner, reference_model: torch.nn.Module, case_list: List[Case], ranges: Ranges, pad_id: int,
                  device: torch.device, rule: Rule, references: Optional[Dict[str, Batch]] = None,
                  eager: Optional[Agreement] = None, label: str = "artifact",
                  decisions: Optional[DecisionAgreement] = None) -> VerifyResult:
    """Figures for one artifact over all cases, and whether it meets `rule` (`eager`: laya's eager forward
    in the artifact's dtype, recorded beside them) and, for a 16-bit artifact, its decision statement
    (`EagerFigures.decisions`). `label` names the artifact on the live line."""
    if references is None:
        references = reference_outputs(reference_model, case_list)
    per_case = {}
    with progress.task("  cases of %s" % label, total=len(case_list)) as line:
        for case in case_list:
            with torch.no_grad():
                got = run_padded(runner, case.batch, ranges, pad_id, device)
            ref = references[case.name]
            per_case[case.name] = compare((ref[0].float(), ref[1].float()), got, case.batch, case.pad_rows)
            line.advance()
    a = _agreement(per_case)
    ok = a.worst <= rule.max_abs and a.argmax_agreement >= rule.argmax_share
    why = None
    if not ok:
        why = ("over tolerance: option probabilities differ from fp32 by up to %.3g, action probabilities by %.3g, "
               "top option agrees on %.1f%% of rows; the rule allows %s"
               % (a.max_abs_option_prob, a.max_abs_action_prob, 100 * a.argmax_agreement, rule.describe()))
    elif decisions is not None and not decisions.holds:
        ok = False
        why = ("its decisions are less faithful to fp32 than laya's eager forward in the same dtype: %s"
               % decisions.describe())
    return VerifyResult(passed=ok, reason=why, tolerance=rule.max_abs, argmax_required=rule.argmax_share,
                        max_abs_option_prob=a.max_abs_option_prob, max_abs_action_prob=a.max_abs_action_prob,
                        argmax_agreement=a.argmax_agreement, rows_compared=sum(c["rows"] for c in per_case.values()),
                        cases=per_case, rule=rule.describe(), eager_in_dtype=eager, decisions=decisions)


@dataclass
class Reference:
    """laya's eager fp32 forward on one set of seeded cases inside one export range, and laya eager's figures in
    each 16-bit dtype on them and on the decision suite: made once (`reference`), shared by every artifact of
    that range that `verify_artifact` checks."""

    model: torch.nn.Module
    ranges: Ranges
    pad_id: int
    tolerance: Tolerance
    cases: List[Case]
    outputs: Dict[str, Batch]
    figures: EagerFigures


def reference(model: torch.nn.Module, ranges: Ranges, vocab: int, pad_id: int, seed: int, tolerance: Tolerance,
              context: Optional[int] = None) -> Reference:
    """The cases (`seed`) and the decision suite (`seed + 1`, `tolerance.decisions` rows) inside `ranges` and, when
    given, the checkpoint's `context`, and `model`'s fp32 outputs on them (autocast off, whatever the caller's)."""
    case_list = cases(seed, ranges, vocab, pad_id, context)
    with torch.autocast(next(model.parameters()).device.type, enabled=False):
        outputs = reference_outputs(model, case_list)
    suite = decision_cases(seed + 1, ranges, vocab, pad_id, context, tolerance.decisions)
    return Reference(model, ranges, pad_id, tolerance, case_list, outputs,
                     EagerFigures(model, case_list, outputs, suite, tolerance.decisions_alpha))


def verify_artifact(runner, dtype: str, ref: Reference, device: str, label: str = "artifact") -> VerifyResult:
    """One artifact (`runner`, in `dtype`) against laya's eager fp32 forward: the one verification the build,
    `laya-aot verify` and the loader (a cross-compiled artifact on its first GPU) all run. The rule is
    `tolerance.rule_for` with laya eager's figures in `dtype` on `device` (the artifact's); a 16-bit artifact
    also needs its decision statement (`EagerFigures.decisions`). `label` names it on the live line."""
    with torch.no_grad(), torch.autocast(torch.device(runner.device).type, enabled=False):
        eager = ref.figures.get(dtype, device)
        decisions = ref.figures.decisions(runner, dtype, ref.ranges, ref.pad_id)
        return verify_runner(runner, ref.model, ref.cases, ref.ranges, ref.pad_id, runner.device,
                             rule_for(dtype, ref.tolerance, eager), ref.outputs, eager, label=label,
                             decisions=decisions)


def latency_ms(fn: Callable[[], Any], repeats: int, sync: Optional[Callable[[], None]] = None) -> float:
    """Median wall time of `fn` after one warm-up call."""
    fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)

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
from .manifest import SmokeRecord, VerifyResult
from .numerics.dtypes import torch_dtype
from .numerics.tolerance import (
    Agreement,
    DecisionAgreement,
    Rule,
    Tolerance,
    decision_statement,
    near_tie_gap,
    rule_for,
)
from .padding import Ranges, action_probs, chunks, for_runner, option_probs, pad_batch

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


def smoke_disagreement(record: Optional[SmokeRecord], ranges: Ranges, vocab: int, pad_id: int,
                       eager_forward: Callable[..., Tuple[torch.Tensor, torch.Tensor]],
                       artifact_forward: Callable[..., Tuple[torch.Tensor, torch.Tensor]],
                       device: torch.device) -> float:
    """The worst probability difference between `artifact_forward` and the reference on the smoke batch: the
    build's fp32 outputs in `record`, else (None) `eager_forward` here on `smoke_batch`. The caller holds it to
    the bound the artifact met at verification."""
    with torch.no_grad():
        if record:
            batch, ref = smoke_from_record(record)
        else:
            batch = smoke_batch(ranges, vocab, pad_id)
            ref = eager_forward(*(x.to(device) for x in batch))
        got = artifact_forward(*(x.to(device) for x in batch))
    c = compare((ref[0].float().cpu(), ref[1].float().cpu()), (got[0].float().cpu(), got[1].float().cpu()), batch, 0)
    return max(c["max_abs_option_prob"], c["max_abs_action_prob"])


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


def near_tie_pool(seed: int, ranges: Ranges, vocab: int, pad_id: int, context: Optional[int], n: int) -> List[Case]:
    """`n` seeded candidate rows for the near-tie part: the decision suite's shapes (`decision_cases`), each row's
    options made alike, as options that differ by little are in real questions: the tokens at and after the first
    marker (2 to 8 of them) are copied to every other marker, so the options differ in their positions and
    neighbours only. Which of them are near ties, fp32's forward decides (`near_tie_cases`)."""
    out = decision_cases(seed, ranges, vocab, pad_id, context, n)
    g = torch.Generator().manual_seed(seed)
    for case in out:
        ids, att, mpos, mmask, _ = case.batch
        for i in range(ids.shape[0]):
            length, pos = int(att[i].sum()), mpos[i][mmask[i]].tolist()
            span = int(torch.randint(2, 9, (1,), generator=g))
            src = ids[i, pos[0]:min(pos[0] + span, length)].clone()
            for p in pos[1:]:
                w = min(len(src), length - p)
                ids[i, p:p + w] = src[:w]
    return out


def _decisions(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The top option of every row (all rows of the decision suite have two options or more)."""
    return option_probs(logits.float().cpu(), batch[2].shape[1]).argmax(-1)


def _row(batch: Batch, i: int) -> Batch:
    """Row `i` of a batch, cut to its own tokens and markers."""
    ids, att, mpos, mmask, qtype = batch
    n, k = int(att[i].sum()), int(mmask[i].sum())
    return ids[i, :n], att[i, :n], mpos[i, :k], mmask[i, :k], qtype[i:i + 1]


def stack_rows(rows: List[Batch], pad_id: int) -> Batch:
    """Rows cut by `_row` as one batch, padded to its longest row and widest marker count (pad id, masked)."""
    t, k = max(r[0].shape[0] for r in rows), max(r[2].shape[0] for r in rows)
    ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), t), dtype=torch.long)
    mpos = torch.zeros((len(rows), k), dtype=torch.long)
    mmask = torch.zeros((len(rows), k), dtype=torch.bool)
    for i, (a, b, c, d, _) in enumerate(rows):
        ids[i, :a.shape[0]], att[i, :b.shape[0]], mpos[i, :c.shape[0]], mmask[i, :d.shape[0]] = a, b, c, d
    return ids, att, mpos, mmask, torch.cat([r[4] for r in rows])


def near_tie_cases(model: torch.nn.Module, pool: List[Case], gap: float, n: int, pad_id: int, device: str,
                   rows_per_call: int = 32) -> List[Case]:
    """Up to `n` rows of `pool` whose top two option probabilities in `model`'s fp32 forward on `device` are at most
    `gap` apart (the near ties: `tolerance.near_tie_gap`), in calls of up to `rows_per_call` rows of similar length.
    The pool is run in order and only as far as it takes."""
    found: List[Batch] = []
    with torch.no_grad(), torch.autocast(torch.device(device).type, enabled=False):
        for case in pool:
            if len(found) >= n:
                break
            logits = model(*(x.to(device) for x in case.batch))[0]
            top2 = option_probs(logits.float().cpu(), case.batch[2].shape[1]).topk(2, -1).values
            close = ((top2[:, 0] - top2[:, 1]) <= gap).nonzero().flatten().tolist()
            found += [_row(case.batch, i) for i in close]
    found = sorted(found[:n], key=lambda r: r[0].shape[0])
    return [Case("near_ties_%d" % (i // rows_per_call), stack_rows(found[i:i + rows_per_call], pad_id))
            for i in range(0, len(found), rows_per_call)]


class EagerFigures:
    """laya's eager forward in each 16-bit dtype on one set of cases (and, given one, on the decision suite and
    the near ties found in `pool`), per device: computed once each, shared by every artifact of that dtype."""

    def __init__(self, model: torch.nn.Module, case_list: List[Case], references: Dict[str, Batch],
                 suite: Optional[List[Case]] = None, alpha: float = 0.01, pool: Optional[List[Case]] = None,
                 near_ties: int = 0, pad_id: int = 0):
        self._model, self._cases, self._refs = model, case_list, references
        self._done: Dict[Tuple[str, str], Agreement] = {}
        self._suite, self._alpha = suite or [], alpha
        self._models: Dict[str, torch.nn.Module] = {}
        self._pool, self._near_n, self._pad_id = pool or [], near_ties, pad_id
        # (device, serving dtype, gap) -> the near-tie cases
        self._near: Dict[Tuple[str, str, float], List[Case]] = {}
        # (device, which suite, "fp32" or the autocast dtype) -> laya eager's decisions
        self._eager: Dict[Tuple[str, str, str], torch.Tensor] = {}

    def _on(self, device: str) -> torch.nn.Module:
        """The model on `device` (one copy per device)."""
        here = next(self._model.parameters()).device
        if torch.device(device) == here:
            return self._model
        if device not in self._models:
            self._models[device] = copy.deepcopy(self._model).to(device)
        return self._models[device]

    def _eager_decisions(self, device: str, dtype: str, suite: List[Case], name: str) -> torch.Tensor:
        """laya's eager forward's decisions on `suite` (called `name`) on `device`, in fp32 or under autocast in
        `dtype` as laya's Agent runs it: once per device, suite and dtype."""
        key = (device, name, dtype)
        if key not in self._eager:
            model = self._on(device)  # on the artifact's device: a GPU build's CPU reference would take minutes
            # autocast keeps its casts of the weights until the outermost autocast region ends, and the caller's
            # (verify_artifact's, disabled) is still open: without clearing, a run in fp16 after one in bf16 got the
            # bf16 copies ("expected m1 and m2 to have the same dtype")
            torch.clear_autocast_cache()
            with torch.no_grad(), torch.autocast(torch.device(device).type, enabled=dtype != "fp32",
                                                 dtype=None if dtype == "fp32" else torch_dtype(dtype)):
                self._eager[key] = torch.cat([_decisions(model(*(x.to(device) for x in c.batch))[0], c.batch)
                                              for c in suite]) if suite else torch.zeros(0, dtype=torch.long)
            torch.clear_autocast_cache()
        return self._eager[key]

    def near_ties(self, device: str, dtype: str, gap: float) -> List[Case]:
        """The near-tie part for artifacts serving `dtype` on `device`: rows of the pool whose fp32 top two options
        are within `gap` (`tolerance.near_tie_gap` of laya eager's error in `dtype` on the verification cases)."""
        key = (device, dtype, gap)
        if key not in self._near:
            self._near[key] = near_tie_cases(self._on(device), self._pool, gap, self._near_n, self._pad_id, device)
            log.info("near ties for %s on %s: %d rows with fp32's top two within %.3g", dtype, device,
                     sum(c.batch[0].shape[0] for c in self._near[key]), gap)
        return self._near[key]

    def decisions(self, runner, dtype: str, ranges: Ranges, pad_id: int, gemm: Optional[str] = None,
                  gap: Optional[float] = None) -> Optional[DecisionAgreement]:
        """The artifact's decisions on the suite, and on its near ties (those within `gap`, the near-tie gap of
        laya eager's figures in `dtype`: `verify_artifact` computes it beside the rule; None: the suite alone),
        against fp32's, paired with laya eager's on the artifact's device in the dtype its matrix products run in
        (`gemm`, its `manifest.Precision.gemm`; None: `dtype`), and beside laya eager's in `dtype`, the agents'
        (None for fp32, which laya serves as the reference itself, or without a suite). A faithful artifact with
        fp16 products is held to laya eager fp16: on near ties that is far above laya eager bf16, so an artifact
        only as faithful as bf16 fails."""
        if dtype == "fp32" or not self._suite:
            return None
        device, against = str(runner.device), gemm if gemm in ("bf16", "fp16") else dtype
        parts = [("suite", self._suite, None)]
        if self._pool and self._near_n and gap is not None:
            parts.append(("near", self.near_ties(device, dtype, gap), gap))
        rights = []
        for name, suite, within in parts:
            ref = self._eager_decisions(device, "fp32", suite, name)
            got = self._artifact_decisions(runner, suite, ranges, pad_id)
            rights.append(((got == ref).tolist(), (self._eager_decisions(device, against, suite, name) == ref).tolist(),
                           within, float((self._eager_decisions(device, dtype, suite, name) == ref).float().mean())
                           if len(ref) else None))
        st = decision_statement(rights[0][0], rights[0][1], self._alpha, rights[1][:3] if len(rights) > 1 else None)
        if against != dtype:
            st.compared_with, st.laya_serving = against, rights[0][3]
            if st.near_ties is not None:
                st.near_ties.compared_with, st.near_ties.laya_serving = against, rights[1][3]
        return st

    @staticmethod
    def _artifact_decisions(runner, suite: List[Case], ranges: Ranges, pad_id: int) -> torch.Tensor:
        if not suite:
            return torch.zeros(0, dtype=torch.long)
        with torch.no_grad():
            return torch.cat([_decisions(run_padded(runner, c.batch, ranges, pad_id, runner.device)[0], c.batch)
                              for c in suite])

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
        why = ("its decisions are less faithful to fp32 than laya's eager forward in %s: %s"
               % (decisions.compared_with or "the same dtype", decisions.describe()))
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


def suites(seed: int, ranges: Ranges, vocab: int, pad_id: int, tolerance: Tolerance,
           context: Optional[int] = None) -> Tuple[List[Case], List[Case]]:
    """The verify suite's cases (`seed`) and its decision suite (`seed + 1`, `tolerance.decisions` rows) inside
    `ranges` and, when given, the checkpoint's `context`: what `reference` checks artifacts on, and what the build
    measures the faithful path's activations on (`kinds/exported_program.choose_precision`)."""
    return (cases(seed, ranges, vocab, pad_id, context),
            decision_cases(seed + 1, ranges, vocab, pad_id, context, tolerance.decisions))


def reference(model: torch.nn.Module, ranges: Ranges, vocab: int, pad_id: int, seed: int, tolerance: Tolerance,
              context: Optional[int] = None) -> Reference:
    """The cases and the decision suite (`suites`), and `model`'s fp32 outputs on the cases (autocast off,
    whatever the caller's)."""
    case_list, suite = suites(seed, ranges, vocab, pad_id, tolerance, context)
    with torch.autocast(next(model.parameters()).device.type, enabled=False):
        outputs = reference_outputs(model, case_list)
    pool = (near_tie_pool(seed + 2, ranges, vocab, pad_id, context, tolerance.near_tie_pool)
            if tolerance.near_ties else [])
    return Reference(model, ranges, pad_id, tolerance, case_list, outputs,
                     EagerFigures(model, case_list, outputs, suite, tolerance.decisions_alpha, pool,
                                  tolerance.near_ties, pad_id))


def verify_artifact(runner, dtype: str, ref: Reference, device: str, label: str = "artifact",
                    gemm: Optional[str] = None) -> VerifyResult:
    """One artifact (`runner`, for agents serving in `dtype`, its matrix products in `gemm`: None, as laya serves)
    against laya's eager fp32 forward: the one verification the build, `laya-aot verify` and the loader (a
    cross-compiled artifact on its first GPU) all run. The rule is `tolerance.rule_for` with laya eager's figures
    in `dtype` on `device` (the artifact's); a 16-bit artifact also needs its decision statement
    (`EagerFigures.decisions`, against laya eager in `gemm`, on the near ties within `tolerance.near_tie_gap` of
    the same figures): the rule and the gap are made here, once, from laya eager's figures. `label` names it on
    the live line."""
    with torch.no_grad(), torch.autocast(torch.device(runner.device).type, enabled=False):
        eager = ref.figures.get(dtype, device)
        rule, gap = rule_for(dtype, ref.tolerance, eager), near_tie_gap(eager) if eager is not None else None
        decisions = ref.figures.decisions(runner, dtype, ref.ranges, ref.pad_id, gemm, gap)
        return verify_runner(runner, ref.model, ref.cases, ref.ranges, ref.pad_id, runner.device, rule, ref.outputs,
                             eager, label=label, decisions=decisions)


Call = Tuple[str, str, Callable[[], Any], Optional[Callable[[], None]]]  # (artifact, shape, call, sync)


def interleaved_ms(calls: List[Call], rounds: int, warmup: int
                   ) -> Tuple[Dict[str, Dict[str, float]], Dict[str, Dict[str, float]]]:
    """Per artifact and shape, the median ms and the spread (90th minus 10th percentile) over `rounds` rounds, each
    round making every call once, one after another, after `warmup` untimed rounds. Interleaved, every artifact
    sees the same moments of a busy machine: timed one artifact after another, a burst of other work fell on one of
    them and the ranking changed from one build (or bench) to the next."""
    with torch.no_grad():
        for _ in range(warmup):
            for _, _, call, sync in calls:
                call()
                if sync:
                    sync()
        times: Dict[Tuple[str, str], List[float]] = {(n, s): [] for n, s, _, _ in calls}
        for _ in range(max(1, rounds)):
            for name, shape, call, sync in calls:
                t0 = time.perf_counter()
                call()
                if sync:
                    sync()
                times[(name, shape)].append((time.perf_counter() - t0) * 1e3)
    medians: Dict[str, Dict[str, float]] = {}
    spread: Dict[str, Dict[str, float]] = {}
    for (name, shape), ts in times.items():
        ordered = sorted(ts)
        medians.setdefault(name, {})[shape] = round(statistics.median(ts), 3)
        spread.setdefault(name, {})[shape] = round(
            ordered[int(0.9 * (len(ordered) - 1))] - ordered[int(0.1 * (len(ordered) - 1))], 3)
    return medians, spread


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

"""The verification rule: how far an artifact may be from the eager fp32 forward. Written once, here.

fp32 artifacts must agree with eager fp32 to 1e-4, top option equal. A 16-bit artifact is judged
against laya's own eager forward in that dtype, whose distance from fp32 depends on the checkpoint:
within max(absolute tolerance, `relative` x that distance), top option agreeing on that share of rows
minus `argmax_margin`. It also carries a decision statement (`DecisionAgreement`: a one-sided McNemar
test that it agrees with fp32 as often as laya eager in its dtype), which is why the runtime serves its
answers at near-ties. The statement has two parts: the seeded decision suite (mostly clear decisions, where
any 16-bit forward agrees with fp32), and its near ties: rows whose fp32 top two options are within the 16-bit
error (`near_tie_gap`), where a less faithful forward shows, each part tested at half the significance level.
The numbers live in the manifest; every check asks `rule_for`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple


def _required() -> Dict[str, Any]:
    return {"required": True}


@dataclass
class Tolerance:
    """The numbers of the rule; the manifest stores them with the bundle."""

    # max abs difference of option/action probabilities against eager fp32, per artifact dtype
    fp32: float = field(default=1e-4, metadata=_required())
    bf16: float = field(default=2e-2, metadata=_required())
    fp16: float = field(default=2e-2, metadata=_required())
    # share of rows whose top option must agree with fp32's, for an fp32 artifact
    argmax_fp32: float = field(default=1.0, metadata=_required())
    # a 16-bit artifact may be this many times as far from fp32 as laya's eager forward in its dtype
    relative: float = 2.0
    # and agree with fp32's top option on this much smaller a share of rows than laya's eager in its dtype
    argmax_margin: float = 0.02
    # the decision suite of a 16-bit artifact: this many decisions, and the significance level of the test
    decisions: int = 2048
    decisions_alpha: float = 0.01
    # and its near-tie part: up to this many rows whose fp32 top two options are within the 16-bit error
    # (`near_tie_gap`), found among at most `near_tie_pool` seeded rows run in fp32; 0 leaves the part out
    near_ties: int = 512
    near_tie_pool: int = 8192


@dataclass
class Agreement:
    """How far one forward is from the eager fp32 forward over the verification cases."""

    max_abs_option_prob: float
    max_abs_action_prob: float
    argmax_agreement: float

    @property
    def worst(self) -> float:
        return max(self.max_abs_option_prob, self.max_abs_action_prob)


@dataclass(frozen=True)
class Rule:
    """What one artifact must meet: `max_abs` on both probability kinds, `argmax_share` of top options."""

    max_abs: float
    argmax_share: float
    basis: str

    def describe(self) -> str:
        return "max |dp| <= %.3g and top option agreeing on >= %.1f%% of rows (%s)" % (
            self.max_abs, 100 * self.argmax_share, self.basis)


def rule_for(dtype: str, tolerance: Tolerance, eager_in_dtype: Optional[Agreement] = None) -> Rule:
    """The rule for an artifact computing in `dtype`; a 16-bit one needs laya's eager figures in that dtype."""
    if dtype == "fp32":
        return Rule(tolerance.fp32, tolerance.argmax_fp32, "fp32: the eager fp32 forward's own precision")
    if dtype not in ("bf16", "fp16"):
        raise ValueError("no verification rule for dtype %r; artifacts compute in fp32, bf16 or fp16" % dtype)
    if eager_in_dtype is None:
        raise ValueError("a %s artifact is judged against laya's eager forward in %s on the same cases; "
                         "its figures are missing" % (dtype, dtype))
    floor = getattr(tolerance, dtype)
    max_abs = max(floor, tolerance.relative * eager_in_dtype.worst)
    share = max(0.0, eager_in_dtype.argmax_agreement - tolerance.argmax_margin)
    basis = ("%s: max(%.3g, %.3g x laya eager %s's %.3g from fp32); laya eager %s's top option agrees on "
             "%.1f%%, margin %.1f%%" % (dtype, floor, tolerance.relative, dtype, eager_in_dtype.worst, dtype,
                                        100 * eager_in_dtype.argmax_agreement, 100 * tolerance.argmax_margin))
    return Rule(max_abs, share, basis)


def tie_margin(artifact: Agreement, eager_in_dtype: Optional[Agreement] = None) -> float:
    """The top-two option gap below which an artifact and laya's eager forward in the same dtype may choose
    differently, from the figures the artifact was verified with.

    On the verification cases the artifact's option probabilities were within `artifact` of fp32 and laya's
    eager forward in its dtype within `eager_in_dtype` (none for fp32: eager fp32 is the reference), so the
    two are within d, the sum, of each other; a row whose top two options are more than 2d apart has the
    same top option in both (softmax at temperature 1; laya's temperatures do not move the top option).
    The runtime hands rows inside the margin to laya's eager forward, so a decision on a near-tie is laya's
    own. Only option probabilities count: decisions are made on options, not on the action head.
    """
    d = artifact.max_abs_option_prob + (eager_in_dtype.max_abs_option_prob if eager_in_dtype is not None else 0.0)
    return 2.0 * d


TEST = "one-sided exact McNemar test on paired decisions (artifact vs laya eager in the same dtype, each against fp32)"


def near_tie_gap(eager_in_dtype: Agreement) -> float:
    """The fp32 top-two option gap below which a row is a near tie for 16-bit forwards in a dtype: twice the
    largest option-probability error of laya's eager forward in that dtype on the verification cases (each of
    the two options may move by that much). Chosen from fp32 and other cases only, so it favours neither the
    artifact nor laya eager."""
    return 2.0 * eager_in_dtype.max_abs_option_prob


@dataclass
class DecisionAgreement:
    """Decisions on the seeded decision suite, each compared with fp32's: the artifact's and laya eager's in the
    same dtype, paired. `p_value`: the chance of the artifact being at least this much worse than laya eager if
    both were equally faithful (the one-sided exact McNemar test on the decisions where exactly one is wrong).
    `near_ties`: the same on the near-tie part (`gap`: its fp32 top-two gap bound); both parts must hold, each
    tested at `alpha` (half the configured level when both exist). `compared_with`: the dtype of the laya eager
    forward paired with, where it is not the agents' dtype (a faithful artifact's matrix-product dtype), and
    `laya_serving` laya eager's agreement in the agents' dtype beside it. The fields after `test` are absent in
    bundles built before they existed."""

    decisions: int
    artifact: float
    eager_in_dtype: float
    artifact_only_wrong: int
    eager_only_wrong: int
    p_value: float
    alpha: float
    test: str = TEST
    near_ties: Optional["DecisionAgreement"] = None
    gap: Optional[float] = None
    compared_with: Optional[str] = None
    laya_serving: Optional[float] = None

    @property
    def holds(self) -> bool:
        return self.p_value >= self.alpha and (self.near_ties is None or self.near_ties.holds)

    def _part(self) -> str:
        which = "laya eager in %s" % self.compared_with if self.compared_with else "laya eager in the same dtype"
        serving = ("; laya eager as it serves: %.2f%%" % (100 * self.laya_serving)
                   if self.laya_serving is not None else "")
        return ("%.2f%% of %d (%s: %.2f%%; %d wrong only here, %d only in laya eager; p = %.3g, alpha %.3g%s)"
                % (100 * self.artifact, self.decisions, which, 100 * self.eager_in_dtype, self.artifact_only_wrong,
                   self.eager_only_wrong, self.p_value, self.alpha, serving))

    def describe(self) -> str:
        text = "decisions agree with fp32 on %s" % self._part()
        near = self.near_ties
        if near is not None:
            text += "; on near ties (fp32 top two within %.3g) on %s" % (near.gap or 0.0, near._part())
        return text


def mcnemar_one_sided(only_artifact_wrong: int, only_eager_wrong: int) -> float:
    """P(X >= only_artifact_wrong) for X ~ Binomial(n, 1/2), n the discordant pairs: exact, in integers."""
    n = only_artifact_wrong + only_eager_wrong
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(only_artifact_wrong, n + 1))
    return tail / 2 ** n


def decision_statement(artifact_right: Sequence[bool], eager_right: Sequence[bool], alpha: float,
                       near: Optional[Tuple[Sequence[bool], Sequence[bool], float]] = None) -> DecisionAgreement:
    """The statement from paired per-decision agreement with fp32 (same decisions, same order); `near`: the
    near-tie part's (artifact right, laya eager right, gap), left out when it holds no decision. With both parts
    each is tested at alpha / 2, so an artifact as faithful as laya eager fails at most `alpha` of the time."""
    if near is not None and len(near[0]):
        overall = _statement(artifact_right, eager_right, alpha / 2)
        overall.near_ties = _statement(near[0], near[1], alpha / 2)
        overall.near_ties.gap = near[2]
        return overall
    return _statement(artifact_right, eager_right, alpha)


def _statement(artifact_right: Sequence[bool], eager_right: Sequence[bool], alpha: float) -> DecisionAgreement:
    n = len(artifact_right)
    if n != len(eager_right) or n == 0:
        raise ValueError("the decision statement needs the same non-empty decisions for both forwards")
    b = sum(1 for a, e in zip(artifact_right, eager_right) if not a and e)
    c = sum(1 for a, e in zip(artifact_right, eager_right) if a and not e)
    return DecisionAgreement(decisions=n, artifact=sum(map(bool, artifact_right)) / n,
                             eager_in_dtype=sum(map(bool, eager_right)) / n, artifact_only_wrong=b,
                             eager_only_wrong=c, p_value=mcnemar_one_sided(b, c), alpha=alpha)

"""The verification rule: how far an artifact may be from the eager fp32 forward. Written once, here.

The build configures it (`verify.tolerance.*`), stores it in the manifest, and every check (build,
`laya-aot verify`, the loader's verification on a GPU and its smoke check) asks `rule_for` what
applies to an artifact of a given dtype. No other module holds a tolerance or a fallback for one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict


def _required() -> Dict[str, Any]:
    return {"required": True}


@dataclass
class Tolerance:
    """Max abs difference of option/action probabilities against eager fp32, per artifact dtype, and the
    share of rows whose top option must agree (fp32 requires all of them)."""

    fp32: float = field(default=1e-4, metadata=_required())
    bf16: float = field(default=2e-2, metadata=_required())
    fp16: float = field(default=2e-2, metadata=_required())
    argmax_fp32: float = field(default=1.0, metadata=_required())
    argmax_16bit: float = field(default=0.95, metadata=_required())


@dataclass(frozen=True)
class Rule:
    """What one artifact must meet: `max_abs` on both probability kinds, `argmax_share` of top options."""

    max_abs: float
    argmax_share: float

    def describe(self) -> str:
        return "max |dp| <= %.3g, top option agreeing on >= %.1f%% of rows" % (self.max_abs, 100 * self.argmax_share)


def rule_for(dtype: str, tolerance: Tolerance) -> Rule:
    """The rule for an artifact computing in `dtype` (fp32, bf16 or fp16)."""
    if dtype == "fp32":
        return Rule(tolerance.fp32, tolerance.argmax_fp32)
    if dtype in ("bf16", "fp16"):
        return Rule(getattr(tolerance, dtype), tolerance.argmax_16bit)
    raise ValueError("no verification rule for dtype %r; artifacts compute in fp32, bf16 or fp16" % dtype)

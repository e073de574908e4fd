"""The matrix products of the faithful 16-bit path (`export.precision=faithful`): the one place that rounds.

laya serves a 16-bit checkpoint under autocast (`laya_aot.numerics.precision`). Its residual stream and norms are fp32
already (autocast runs layer norms in fp32 and a 16-bit branch added to an fp32 stream is promoted), but every
`nn.Linear` rounds its output to 16 bits, the GeGLU between two of them runs on those 16-bit values, and the
scorer's last product hands back option logits rounded to 16 bits: in bf16 (8 significant bits) a few
hundredths of a logit, which decides near ties.

On the faithful path nothing runs under autocast: the model is fp32 and only its matrix products round. `linear`
takes the input and the weight in `weight.dtype` (fp16 where the checkpoint's activations stay in range, else
bf16: `precision.gemm_dtype`), accumulates in fp32, and from its output on everything is fp32 again (the bias
added in fp32, the activations, the residual stream, norms, softmax, the scorer and its logits). The weights are
cast once, so an artifact reads them in 16 bits; an fp16 product is as fast as a bf16 one on a GPU.

`record()` measures the largest |input| and |output| of every product on fp32 forwards (a module whose products
run in fp32): what the build's choice of fp16 reads (`model.gemm_extremes`).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F


@dataclass
class Extremes:
    """The largest |input| and |output| of the products seen, and where (the module's name)."""

    max_abs_input: float = 0.0
    max_abs_output: float = 0.0
    input_at: str = ""
    output_at: str = ""
    products: int = 0

    def see(self, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        self.products += 1
        for attr, at, t in (("max_abs_input", "input_at", x), ("max_abs_output", "output_at", y)):
            m = float(t.detach().abs().max()) if t.numel() else 0.0
            if not math.isfinite(m):
                m = math.inf
            if m > getattr(self, attr):
                setattr(self, attr, m)
                setattr(self, at, name)


_recording: Optional[Extremes] = None


@contextlib.contextmanager
def record() -> Iterator[Extremes]:
    """Every `linear` call inside the block reports its input and output (eager forwards only; one at a time)."""
    global _recording
    before, _recording = _recording, Extremes()
    try:
        yield _recording
    finally:
        _recording = before


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, name: str = "") -> torch.Tensor:
    """`F.linear` with the input cast to the weight's dtype, fp32 accumulation, and the output (then the bias) in
    fp32."""
    y = F.linear(x.to(weight.dtype), weight)
    if _recording is not None:
        _recording.see(name, x, y)
    y = y.float()
    return y if bias is None else y + bias.float()


def linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An `nn.Linear`'s forward on the faithful path (`install` gives it to the module)."""
    return linear(x, self.weight, self.bias, getattr(self, "laya_aot_name", ""))


def cast_weight(module: torch.nn.Module, attr: str, dtype: torch.dtype) -> None:
    """Replace `module.<attr>` (a parameter) by its copy in `dtype`, keeping its name."""
    p = getattr(module, attr)
    setattr(module, attr, torch.nn.Parameter(p.detach().to(dtype), requires_grad=False))

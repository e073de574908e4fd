"""The portable `torch.export` program: what every other artifact is compiled from.

Tokens are declared as `16 * Dim`: a plain range trips the exporter's own `L % 8` alignment guard on
ModernBERT's attention mask. Built always (no switch): a build that cannot export stops. It never serves an agent
(it runs at eager speed) and holds a copy of every weight, so it is written into the bundle (and verified like the
others) only with `export.ship_program=true`. Its build settings (`export.*`: the ranges, the action head's dtype)
are `exported_program_settings.ExportConfig`.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from torch.export import Dim, ExportedProgram

from ..errors import one_line
from ..manifest import Artifact, Needs, Precision
from ..modeling import packed as packed_mod
from ..modeling.head import attention_backends
from ..modeling.model import ExplicitDtypeModel, check_choices, gemm_extremes
from ..modeling.rotary import ROTARY
from ..numerics import precision
from ..numerics.dtypes import torch_dtype
from ..padding import MAX_ROWS, TOKEN_MULTIPLE, Ranges, context_tokens
from ..variant import Machine, torch_tag
from .base import BuildContext, Built, Exported, Kind, LoadEnv, Runner

log = logging.getLogger(__name__)

NAME = "exported_program"
# the default: the program carries a copy of every weight and no runtime reads it (ExportConfig.ship_program)
NOT_SHIPPED = "export.ship_program=false (no runtime reads it; the compiled kinds are built from the program in memory)"


GPU_EXAMPLE = (8, 1024)  # rows, tokens: the sizes a GPU export is traced and tuned at (ExportConfig.example_rows)
CPU_EXAMPLE = (3, 48)


def example_size(device: str, max_rows: int, max_tokens: int, rows: Optional[int] = None,
                 tokens: Optional[int] = None) -> Tuple[int, int]:
    """The example batch's rows x tokens: asked for, or the device's default, within what the export declares.

    Every size must be > 1 (a size of 1 would be specialised) and tokens a multiple of TOKEN_MULTIPLE of at
    least 2 * TOKEN_MULTIPLE (the exporter raises ModernBERT's minimum to 32). The export's own extents are checked
    first, so a bad one is named rather than the example it makes."""
    if max_tokens < 2 * TOKEN_MULTIPLE or max_tokens % TOKEN_MULTIPLE:
        raise ValueError("export.max_tokens=%d must be a multiple of %d and at least %d"
                         % (max_tokens, TOKEN_MULTIPLE, 2 * TOKEN_MULTIPLE))
    if not 2 <= max_rows <= MAX_ROWS:
        raise ValueError("export.max_rows=%d must be between 2 and %d (wider requests run in slices of it)"
                         % (max_rows, MAX_ROWS))
    d_rows, d_tokens = GPU_EXAMPLE if str(device).startswith("cuda") else CPU_EXAMPLE
    got = min(rows or d_rows, max_rows), min(tokens or d_tokens, max_tokens)
    if got[0] < 2 or got[1] < 2 * TOKEN_MULTIPLE or got[1] % TOKEN_MULTIPLE:
        raise ValueError("export.example_rows=%s, export.example_tokens=%s make a %d x %d example: it needs at least "
                         "2 rows and a multiple of %d tokens of at least %d; leave both null for the device's default"
                         % (_null(rows), _null(tokens), got[0], got[1], TOKEN_MULTIPLE, 2 * TOKEN_MULTIPLE))
    return got


def _null(value: Optional[int]) -> str:
    return "null" if value is None else str(value)


def example_inputs(max_tokens: int, pad_id: int, device: str = "cpu", max_rows: int = 3,
                   rows: Optional[int] = None, tokens: Optional[int] = None) -> Tuple[torch.Tensor, ...]:
    """A batch whose sizes are all > 1 and inside the declared ranges, so the exporter specialises none of them;
    rows x tokens from `example_size`."""
    g = torch.Generator().manual_seed(0)
    rows, tokens = example_size(device, max_rows, max_tokens, rows, tokens)
    markers = 3
    ids = torch.randint(5, 200, (rows, tokens), generator=g)
    att = torch.ones(rows, tokens, dtype=torch.long)
    att[1, tokens - 5:] = 0
    ids[1, tokens - 5:] = pad_id
    mpos = torch.tensor([[2, 5, 9]] * rows)
    mmask = torch.ones(rows, markers, dtype=torch.bool)
    qtype = torch.arange(rows) % 3
    return tuple(t.to(device) for t in (ids, att, mpos, mmask, qtype))


def dynamic_shapes(max_rows: int, max_tokens: int, max_markers: int, layout: str = "padded"
                   ) -> Dict[str, Dict[int, object]]:
    """The declared ranges; packed rows (`modeling.packed`) add the packed row, up to every row's tokens."""
    rows = Dim("rows", min=1, max=max_rows)
    tokens = TOKEN_MULTIPLE * Dim("tokens_16", min=1, max=max_tokens // TOKEN_MULTIPLE)
    markers = Dim("markers", min=2, max=max_markers)
    shapes: Dict[str, Dict[int, object]] = {
        "input_ids": {0: rows, 1: tokens}, "attention_mask": {0: rows, 1: tokens},
        "marker_pos": {0: rows, 1: markers}, "marker_mask": {0: rows, 1: markers}, "qtype": {0: rows}}
    if layout == "packed":
        packed = TOKEN_MULTIPLE * Dim("packed_16", min=1, max=max_rows * max_tokens // TOKEN_MULTIPLE)
        shapes.update({name: {1: packed} for name in packed_mod.INPUT_NAMES[:5]}, rows_index={0: rows, 1: tokens})
    return shapes


def export_model(module: ExplicitDtypeModel, max_rows: int, max_tokens: int, max_markers: int,
                 pad_id: int, device: str = "cpu", example: Optional[Tuple[Optional[int], Optional[int]]] = None
                 ) -> ExportedProgram:
    layout = "packed" if isinstance(module, packed_mod.PackedModel) else "padded"
    args = example_inputs(max_tokens, pad_id, device, max_rows, *(example or (None, None)))
    if layout == "packed":
        args = tuple(t.to(device) for t in packed_mod.pack(tuple(t.cpu() for t in args), pad_id, TOKEN_MULTIPLE))
    with torch.no_grad(), attention_backends():
        return torch.export.export(module.to(device), args, strict=False,
                                   dynamic_shapes=dynamic_shapes(max_rows, max_tokens, max_markers, layout))


def ranges_of(ep: ExportedProgram) -> Ranges:
    """The ranges the exporter actually proved, read from the program's input shapes.

    They can be narrower than asked (the exporter raised the token minimum to 32 for ModernBERT), and the
    runtime must pad to what the program accepts, not to what was requested.
    """
    user = {n.name: n for n in ep.graph.nodes if n.op == "placeholder" and n.name in ep.graph_signature.user_inputs}
    ids_shape = user["attention_mask"].meta["val"].shape  # rows x tokens, padded or packed
    mpos_shape = user["marker_pos"].meta["val"].shape

    def bounds(sym) -> Tuple[int, int]:
        if isinstance(sym, int):
            return sym, sym
        expr = sym.node.expr
        vr = ep.range_constraints.get(expr)
        if vr is None:  # an expression such as 16*s2: bound it through its free symbol
            (free,) = expr.free_symbols
            inner = ep.range_constraints[free]
            scale = int(expr / free)
            return int(inner.lower) * scale, int(inner.upper) * scale
        return int(vr.lower), int(vr.upper)

    r0, r1 = bounds(ids_shape[0])
    t0, t1 = bounds(ids_shape[1])
    m0, m1 = bounds(mpos_shape[1])
    return Ranges(min_rows=r0, max_rows=r1, min_tokens=t0, max_tokens=t1, min_markers=m0, max_markers=m1)


class ExportedProgramRunner(Runner):
    """The portable ExportedProgram run as a module (verification only: it is eager speed)."""

    def __init__(self, path: Path, device: str = "cpu", attention: str = "stock", rows: str = "padded"):
        self.device = torch.device(device)  # the device the program was exported on
        if attention.startswith("triton"):  # the program calls the kernel's op: registered before it is read
            from ..modeling import window_attention  # noqa: F401
        self._module = torch.export.load(str(path)).module()
        self.packed = rows == "packed"
        self.stats = {}

    def __call__(self, ids, att, mpos, mmask, qtype):
        batch = (ids, att, mpos, mmask, qtype)
        if self.packed:
            batch = tuple(t.to(self.device) for t in packed_mod.pack(tuple(t.cpu() for t in batch), 0))
        with torch.no_grad():
            return self._module(*batch)


def export_device(target_device: str) -> str:
    """Where the export traces: the GPU for a cuda target where one is visible, else the CPU."""
    return "cuda" if target_device == "cuda" and torch.cuda.is_available() else "cpu"


def check_settings(e: Any, target_device: str, max_tokens: Optional[int] = None) -> None:
    """Every `export.*` setting, each by its owner's check, as one ValueError naming the setting: called as the build
    starts (before the checkpoint loads, `max_tokens` not yet known where it is the context's) and by `build`."""
    dev = export_device(target_device)
    example_size(dev, e.max_rows, int(max_tokens or e.max_tokens or 2 * TOKEN_MULTIPLE), e.example_rows,
                 e.example_tokens)
    precision.check_policy(e.precision, e.fp16_headroom)
    torch_dtype(e.action_head_dtype)
    check_choices(e.attention, e.head)
    if e.rotary not in ROTARY:
        raise ValueError("export.rotary=%r: one of %s" % (e.rotary, ", ".join(ROTARY)))
    if e.rows not in packed_mod.ROWS:
        raise ValueError("export.rows=%r: one of %s" % (e.rows, ", ".join(packed_mod.ROWS)))
    if e.rows == "packed" and dev not in packed_mod.DEVICES:
        raise ValueError("export.rows=packed is for GPU targets, where one kernel visits only each segment's keys; on "
                         "the %s a packed artifact answered slower than padded rows (2.2x on the tiny demo's mixed "
                         "stream): use export.rows=padded" % dev)


def build(ctx: BuildContext, exported: Optional[Exported] = None) -> Built:
    """torch.export with explicit dtypes; the program is saved as the portable artifact and handed back
    (`Built.exported`) for the kinds compiled from it."""
    e = ctx.cfg.export
    reach = context_tokens(ctx.info["max_len"])
    max_tokens = int(e.max_tokens or reach)
    if max_tokens > reach:
        raise ValueError("export.max_tokens=%d exceeds the checkpoint's context (%d tokens, %d as a multiple of %d); "
                         "lower it" % (max_tokens, ctx.info["max_len"], reach, TOKEN_MULTIPLE))
    dev = export_device(ctx.device)
    check_settings(e, ctx.device, max_tokens)
    chosen = choose_precision(ctx, dev, max_tokens)
    model = packed_mod.PackedModel if e.rows == "packed" else ExplicitDtypeModel
    module = model(ctx.agent.model, torch_dtype(ctx.dtype), torch_dtype(e.action_head_dtype), dev,
                   attention=e.attention, rope_table=max_tokens if e.rotary == "table" else 0,
                   head=e.head, gemm=torch_dtype(chosen.gemm) if chosen.policy == "faithful" else None)
    t0 = time.perf_counter()
    example = example_size(dev, e.max_rows, max_tokens, e.example_rows, e.example_tokens)
    program = export_model(module, e.max_rows, max_tokens, e.max_markers, ctx.pad_id, dev, example)
    seconds = time.perf_counter() - t0
    made = Exported(program, ctx.dtype, ranges_of(program), module.attention, module.rotary, module.head,
                    "%dx%d" % example, chosen, e.rows)
    rel = "exported_program/%s.pt2" % ctx.dtype
    path = ctx.staging / rel
    name = "%s-%s" % (NAME, ctx.dtype)
    why = NOT_SHIPPED if not e.ship_program else _unshippable(program, path)
    if why:  # the compiled kinds take the in-memory program; a file no runtime reads is not shipped
        (log.info if why == NOT_SHIPPED else log.warning)("%s is not shipped: %s", name, why)
        return Built("ranges %s; %s attention; rotary %s; head %s; example %s; %s; %s not shipped: %s"
                     % (made.ranges.as_dict(), made.attention, made.rotary, made.head, made.example,
                        chosen.describe(), name, why), exported=made)
    ctx.add_artifact(KIND, name, rel, dev, ctx.dtype, seconds, ranges=made.ranges,
                     details=made.details(), precision=chosen)
    return Built("ranges %s; %s attention; rotary %s; head %s; example %s; %s"
                 % (made.ranges.as_dict(), made.attention, made.rotary, made.head, made.example, chosen.describe()),
                 exported=made)


def choose_precision(ctx: BuildContext, device: str, max_tokens: int) -> Precision:
    """How the artifacts of `ctx.dtype` compute (`precision.gemm_dtype`): for the faithful path in 16 bits, the
    faithful matrix products measured once per build in fp32 on the verify suite's cases (drawn as the verify
    stage draws them, inside the export's ranges) on `device`; the choice is logged, a warning where fp16 would
    risk overflow."""
    e = ctx.cfg.export
    policy, headroom = str(e.precision), float(e.fp16_headroom)
    precision.check_policy(policy, headroom)
    if ctx.dtype == "fp32" or policy == "laya" or ctx.device != "cuda":
        gemm, why = precision.gemm_dtype(ctx.dtype, policy, headroom=headroom, device=ctx.device)
        return Precision(policy, gemm, why)
    if ctx.gemm_extremes is None:
        from omegaconf import OmegaConf  # the build's: a serving process imports this module, never this function

        from .. import verification
        from ..numerics.tolerance import Tolerance

        t0 = time.perf_counter()
        tol = Tolerance(**OmegaConf.to_container(ctx.cfg.verify.tolerance, resolve=True))
        asked = Ranges(1, e.max_rows, 2 * TOKEN_MULTIPLE, max_tokens, 2, e.max_markers)
        case_list, suite = verification.suites(ctx.cfg.verify.seed, asked, ctx.vocab, ctx.pad_id, tol)
        ctx.gemm_extremes = gemm_extremes(ctx.agent.model, [c.batch for c in case_list + suite], device)
        log.info("matrix products measured in fp32 on %d cases and %d decision rows in %.1f s: largest |input| "
                 "%.4g (%s), |output| %.4g (%s)", len(case_list), sum(c.batch[0].shape[0] for c in suite),
                 time.perf_counter() - t0, ctx.gemm_extremes.max_abs_input, ctx.gemm_extremes.input_at,
                 ctx.gemm_extremes.max_abs_output, ctx.gemm_extremes.output_at)
    x = ctx.gemm_extremes
    worst_at = x.input_at if x.max_abs_input >= x.max_abs_output else x.output_at
    gemm, why = precision.gemm_dtype(ctx.dtype, policy, x.max_abs_input, x.max_abs_output, headroom, worst_at,
                                     ctx.device)
    (log.warning if gemm == "bf16" else log.info)(
        "%s artifacts: matrix products in %s: %s", ctx.dtype, gemm, why)
    return Precision(policy, gemm, why, _finite(x.max_abs_input), _finite(x.max_abs_output), headroom)


def _finite(v: float) -> Optional[float]:
    """A measured figure as the manifest holds it (JSON has no infinity: None, the reason says it)."""
    return round(v, 6) if math.isfinite(v) else None


def _unshippable(program: ExportedProgram, path: Path) -> str:
    """Why the saved program cannot ship ("" when it can; a file that cannot is removed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    why = _does_not_save(program, path) or _does_not_load_back(path)
    if why:
        path.unlink(missing_ok=True)
    return why


def _does_not_save(program: ExportedProgram, path: Path) -> str:
    """Why torch cannot save the program ("" when it can): torch 2.11's serializer, for one, has no entry for the
    uint64 state tensor of a program that calls flash attention directly (KeyError: torch.uint64)."""
    try:
        torch.export.save(program, str(path))
    except Exception as e:  # noqa: BLE001 - any failure to serialise means the same: not shipped
        return "torch %s cannot save the program (%s)" % (torch.__version__.split("+")[0], one_line(e, 200))
    return ""


def _does_not_load_back(path: Path) -> str:
    """Why torch cannot load the program it just saved ("" when it can). torch 2.11 saves autocast regions
    it cannot read back (`SpecViolationError: Node.meta wrap_with_autocast_2 is missing val field`)."""
    try:
        torch.export.load(str(path))
    except Exception as e:  # noqa: BLE001 - any failure means the file is unusable on this torch
        return "torch %s cannot load back the program it saved (%s: %s); the compiled artifacts are built " \
               "from the program in memory and verified as usual" % (torch.__version__.split("+")[0],
                                                                     type(e).__name__, str(e)[:200])
    return ""


def load(path: Path, art: Artifact, env: LoadEnv) -> Runner:
    return ExportedProgramRunner(path, env.device, str(art.details.get("attention", "stock")),
                                 str(art.details.get("rows", "padded")))


def needs(m: Machine, device: str) -> Needs:
    return Needs(device=device, torch=m.torch)


KIND = Kind(name=NAME, stage=NAME, build=build, load=load, order=99, optional=False, serves=False, needs=needs,
            variant=lambda m, device: "%s-any" % torch_tag(m.torch), interchangeable=True, config_section="export")

"""What an artifact kind is: its facts, its build step, its load step, and what each is handed.

One module per kind (`kinds/aoti.py`, ...) fills in a `Kind`; `kinds/registry.py` registers them.
The build pipeline runs `Kind.build(ctx, exported)` with a `BuildContext` and the portable program the
exported_program kind handed back (`Exported`); a build step returns a `Built`, which the pipeline
records. The loader, the probe child and `laya-aot verify` run `Kind.load` with a `LoadEnv`. Neither
half knows a kind by its name.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..manifest import Artifact, Needs, Precision
from ..padding import Ranges
from ..variant import Machine, native_variant

if TYPE_CHECKING:  # the schema only: the runtime, which imports the kinds too, never loads Hydra
    from torch.export import ExportedProgram

    from ..config import BuildConfig

Outputs = Tuple[torch.Tensor, torch.Tensor]


class Runner:
    """Runs one artifact: padded tensors in, `(logits, act_logits)` out; `device` is where inputs must live, unless
    `takes_host_inputs`: then inputs may be on any device and the outputs come back on the inputs' device (the
    runner moves them itself, where it can do so with fewer copies)."""

    device = torch.device("cpu")
    takes_host_inputs = False
    stats: Dict[str, Any]

    def __call__(self, ids, att, mpos, mmask, qtype) -> Outputs:  # pragma: no cover - interface
        raise NotImplementedError


class Incoming:
    """Weights allocated on the device, their bytes not yet written: `fill` writes them, run by whoever takes them
    once it has handed them to the artifact.

    A package that reads its constants in place (AOTInductor's `user_managed`) can be handed them unwritten. On an
    H200 torch 2.11's hand-over took 0.15-0.25 s before the copy, 0.3-0.6 s after it and 1.1 s with the copy
    running beside it, so the copy starts after it, beside the package's first call (what that call loads lazily).
    `wait` is the only way to the bytes: nothing may answer with these tensors before it returned."""

    def __init__(self, tensors: Dict[str, torch.Tensor], fill: Callable[[], None]):
        self.tensors = tensors
        self._fill = fill
        self._started = threading.Lock()
        self._done = threading.Event()
        self._error: Optional[BaseException] = None

    def fill(self) -> None:
        """Write the bytes (once: a second caller waits for the first's copy); a failure is kept for `wait`."""
        if not self._started.acquire(blocking=False):
            self._done.wait()
            return
        try:
            self._fill()
        except Exception as e:  # noqa: BLE001 - raised to whoever waits for the bytes
            self._error = e
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> Dict[str, torch.Tensor]:
        """The tensors, once every byte is on the device."""
        self._done.wait()
        if self._error is not None:
            raise RuntimeError("the weights could not be copied to the device: %s: %s"
                               % (type(self._error).__name__, self._error)) from self._error
        return self.tensors


class Skip(Exception):
    """A build step that does not apply to this target or machine (recorded as skipped with the reason)."""


@dataclass
class LoadEnv:
    """What a kind's load step may use. Kinds take what they need: AOTInductor the weights by name,
    the compile route the model, TileLang laya's agent."""

    device: str
    tensors: Optional[Mapping[str, torch.Tensor]] = None
    model: Optional[torch.nn.Module] = None
    agent: Any = None
    cuda_graphs: bool = False
    # the weights already on the device, from the kind's `prepare` (run beside laya's load), or a function that
    # waits for them (the load does what it can first); None: make them
    prepared: Optional[Mapping[str, torch.Tensor] | Callable[[], Any]] = None
    # batches to call the artifact with while `prepared` weights are still being written (`Incoming`): their
    # outputs are thrown away; what a first call loads lazily is paid beside the copy (shapes are what matter)
    early_calls: Sequence[Sequence[torch.Tensor]] = ()


@dataclass(frozen=True)
class Exported:
    """The portable program of one dtype: what the exported_program kind hands the kinds compiled from it."""

    program: "ExportedProgram"
    dtype: str
    # the ranges the exporter proved (`exported_program.ranges_of`): what every artifact of it accepts
    ranges: Ranges
    # how the program computes attention (`ExplicitDtypeModel.attention`): "triton" or "stock"
    attention: str = "stock"
    # where the rotary cos/sin come from (`ExplicitDtypeModel.rotary`): "table" or "computed"
    rotary: str = "computed"
    # where the head's last layer runs (`ExplicitDtypeModel.head`): "answer_rows" or "full"
    head: str = "full"
    # the example batch it was traced and tuned at, rows x tokens (`exported_program.example_size`)
    example: str = ""
    # how it computes (`export.precision`, `precision.gemm_dtype`): what every artifact of it records
    precision: Optional[Precision] = None
    # how the encoder takes a call's rows (`export.rows`): "padded" or "packed" (`modeling.packed`)
    rows: str = "padded"

    def details(self) -> Dict[str, str]:
        """How the program was made, as every artifact of it records it in `Artifact.details`."""
        return {"attention": self.attention, "rotary": self.rotary, "head": self.head, "example": self.example,
                "rows": self.rows}


@dataclass
class Built:
    """What a kind's build step hands back to the pipeline, which records it in the stage's entry."""

    summary: str
    # more facts for the stage's entry in the manifest (TileLang: the seconds its compiles took)
    record: Dict[str, Any] = field(default_factory=dict)
    # the exported_program kind only: the program the later kinds of this dtype are compiled from
    exported: Optional[Exported] = None


@dataclass
class BuildContext:
    """What the build's steps share (`pipeline.stages` drives it). Kinds read it and record artifacts with
    `add_artifact`; what one kind hands the next is a `Built`, returned, not a field set here."""

    cfg: "BuildConfig"
    ckpt: Path
    info: Dict[str, Any]
    staging: Path
    machine: Machine
    device: str
    # the dtypes the build makes artifacts in (precision.build_dtypes), and the one being built now
    dtypes: List[str]
    dtype: str = ""
    agent: Any = None
    fingerprint: Dict[str, Any] = field(default_factory=dict)
    pad_id: int = 0
    vocab: int = 0
    # the program of the dtype being built, from the last exported_program stage (set by the pipeline)
    exported: Optional[Exported] = None
    artifacts: List[Artifact] = field(default_factory=list)
    stages: List[Dict[str, Any]] = field(default_factory=list)
    eager_latency_ms: Optional[Dict[str, float]] = None
    smoke: Optional[Dict[str, Any]] = None
    # laya's tokenizer as a proven snapshot (`tokenizer_snapshot.make`: key, JSON text), shipped in the manifest
    tokenizer_snapshot: Optional[Tuple[str, str]] = None
    # the faithful path's matrix products measured once per build in fp32 (`model.gemm_extremes`), for every dtype
    gemm_extremes: Any = None

    @property
    def ranges(self) -> Optional[Ranges]:
        """The ranges of the current program (None before the first export)."""
        return self.exported.ranges if self.exported else None

    def artifact_name(self, kind: "Kind", base: Optional[str] = None) -> str:
        """`<kind>-<target>` (or `base`), with `-<dtype>` when the build makes more than one dtype."""
        suffix = "-%s" % self.dtype if len(self.dtypes) > 1 and not kind.fixed_dtype else ""
        return "%s%s" % (base or "%s-%s" % (kind.name, self.cfg.target.name), suffix)

    def add_artifact(self, kind: "Kind", name: str, rel: str, device: str, dtype: str, seconds: float,
                     details: Optional[Dict[str, Any]] = None, gpu_arch: Optional[str] = None,
                     ranges: Optional[Ranges] = None, precision: Optional[Precision] = None) -> Artifact:
        """Record an artifact the kind wrote under `staging/rel`; its needs and variant come from the kind, its
        ranges from the current program (`ranges`: the exported_program kind's own, before it is handed on), how it
        computes from the kind (`precision`: the program's, for a kind compiled from it)."""
        arch = (gpu_arch or self.cfg.target.arch or self.machine.gpu_arch) if device == "cuda" else None
        machine = self.machine if device == "cpu" else replace(self.machine, gpu_arch=arch,
                                                               cuda=torch.version.cuda or self.machine.cuda)
        art = Artifact(name=name, kind=kind.name, path=rel, status="built", variant=kind.variant(machine, device),
                       needs=kind.needs(machine, device), device=device, dtype=dtype,
                       action_head_dtype=self.cfg.export.action_head_dtype if kind.serves_dtype_head else "fp32",
                       ranges=ranges or self.ranges, build_seconds=round(seconds, 3), details=details or {},
                       precision=precision)
        self.artifacts.append(art)
        return art


@dataclass(frozen=True)
class Misfit:
    """Why a machine cannot run an artifact for what its kind alone needs of it (`Kind.misfit`)."""

    # the reason, with its fix
    why: str
    # an install fixes it (a library's version, torch's exact build); False: this machine's hardware never will
    software: bool = True


def native_needs(m: Machine, device: str) -> Needs:
    """What compiled native code needs: this torch build and ABI, and the CPU ISA or GPU architecture."""
    if device == "cpu":
        return Needs(device="cpu", torch=m.torch, cxx11_abi=m.cxx11_abi, cpu_isa=m.cpu_isa, machine=m.machine,
                     os=m.os)
    return Needs(device="cuda", torch=m.torch, cxx11_abi=m.cxx11_abi, gpu_arch=m.gpu_arch, cuda=m.cuda,
                 machine=m.machine, os=m.os)


@dataclass(frozen=True)
class Kind:
    """One artifact kind: its facts, and the two halves (build, load) that must agree on its layout."""

    name: str
    # the build stage that makes it, recorded in the manifest; also its `stages.<stage>` switch when optional
    stage: str
    # build(ctx, exported) -> Built: `exported` is None for the exported_program kind, the program otherwise
    build: Callable[[BuildContext, Optional[Exported]], Built]
    load: Callable[[Path, Artifact, LoadEnv], Runner]
    # rank among runtime kinds when the bundle measured no latency on this kind of device (lower first)
    order: int
    # False: always built, and a failure stops the build (the program the others are compiled from)
    optional: bool = True
    # False: never installed into an agent (the portable program runs at eager speed)
    serves: bool = True
    # loads native code that can crash its process: a child process runs it first
    native: bool = False
    # False: the build cannot run it (cross-compiled); the first GPU that loads it verifies it
    verified_at_build: bool = True
    # `laya-aot verify` re-runs its numerical check (False: only its hash is checked there)
    reverify: bool = True
    # small calls may be replayed as CUDA graphs (the runner exposes `graphs`)
    cuda_graphs: bool = False
    # whether the action head runs in `export.action_head_dtype` (False: fp32, as ONNX is exported)
    serves_dtype_head: bool = True
    # built once, in this dtype, whatever the target's dtypes (ONNX Runtime on the CPU: fp32)
    fixed_dtype: Optional[str] = None
    # machine-independent, and two builds from one checkpoint with the same export settings are the same
    # program in different bytes (the exporters are not byte-reproducible): `merge` keeps one of them
    interchangeable: bool = False
    needs: Callable[[Machine, str], Needs] = native_needs
    variant: Callable[[Machine, str], str] = native_variant
    # what the kind alone needs of a machine beyond the shared facts `variant.mismatch` compares (a library's
    # version, the exact build a precompiled function is bound to), recorded in its `needs` or its `details`:
    # misfit(artifact, machine) -> why not, with the fix (None: it fits). Asked first; its reason is the only one
    misfit: Callable[[Artifact, Machine], Optional[Misfit]] = lambda art, machine: None
    # why an agent on this device should not use it even when the machine fits (None: it may)
    refuse_device: Callable[[str], Optional[str]] = lambda device: None
    # runs laya's own module (its weights, its forward): the loader builds laya's eager module first
    needs_module: bool = False
    # what a probe child loads it with (stand-in weights, or laya's agent); only for native kinds
    probe_env: Optional[Callable[[Path, Artifact, Path, str], LoadEnv]] = None
    # prepare(path, tensors, device): the weights its load takes, put on the device before the artifact itself
    # is loaded (the loader runs it beside laya's load and the probe child); None: the load reads them itself
    prepare: Optional[Callable[[Path, Mapping[str, torch.Tensor], str], Any]] = None
    # the manifest reader's hook: why `Artifact.details` breaks this kind's layout ("FIELD: expected ..., got
    # ..."), or None; the reader refuses the bundle with it, naming the field
    check_details: Callable[[Dict[str, Any]], Optional[str]] = lambda details: None
    # the build config's section of this kind's own settings (`BuildConfig.<config_section>`, read as
    # `ctx.cfg.<config_section>`), typed by a dataclass in its torch-free `kinds/<stage>_settings.py`; None: none
    config_section: Optional[str] = None

    def replays_graphs(self, device: str) -> bool:
        """Whether an agent on `device` replays this kind's small calls as CUDA graphs (the loader's default,
        `load(cuda_graphs=True)`); the build times an artifact the same way, so its mix is what serving pays."""
        return self.cuda_graphs and torch.device(device).type == "cuda"


def model_tensors(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter and buffer of a DecisionModel by name, non-persistent buffers included."""
    out = dict(model.named_parameters())
    out.update(dict(model.named_buffers()))
    return out

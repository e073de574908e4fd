"""AOTInductor packages: compiled ahead of time per target, weights supplied at load from the checkpoint.

`aot_inductor.package_constants_in_so=False` makes the package a few MB instead of the model's size,
so a bundle for N architectures does not carry N copies of the weights. `constants.json` beside the
package says where each constant comes from at load time: a tensor of the checkpoint's
model.safetensors (converted to the dtype it names) or, for the few tensors a checkpoint does not
hold (RoPE frequencies, lifted constants), `extra_constants.safetensors`. With `aoti.cpu_frozen=true` a CPU
build also makes a package with the weights frozen inside (`aoti-cpu-frozen`), which Inductor pre-packs for
oneDNN; that one ships unpacked (`model.so`, see `unpack_library`). Its build settings (`aoti.cxx`, `aoti.cpu_frozen`)
are `aoti_settings.AotiConfig`.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.export import ExportedProgram

from ..errors import one_line
from ..manifest import Artifact
from ..modeling.head import attention_backends
from .aoti_compiler import _default_cxx, choose_compiler
from .base import BuildContext, Built, Exported, Incoming, Kind, LoadEnv, Outputs, Runner, Skip

if TYPE_CHECKING:
    from ..checkpoint import Weights

log = logging.getLogger(__name__)

NAME = "aoti"
PACKAGE = "model.pt2"
LIBRARY = "model.so"  # a frozen CPU package's shared library, shipped out of its zip (`unpack_library`)
CONSTANTS = "constants.json"
EXTRA = "extra_constants.safetensors"
WRAPPER_PREFIX = "model."


def constants_spec(ep: ExportedProgram, checkpoint_keys: Iterable[str]) -> Dict[str, Any]:
    """For every constant of the program: its dtype and where the runtime finds its value."""
    keys = set(checkpoint_keys)
    spec: Dict[str, Dict[str, str]] = {}
    extra: Dict[str, torch.Tensor] = {}
    tensors = dict(ep.state_dict)
    tensors.update({k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor)})
    for fqn, t in sorted(tensors.items()):
        key = fqn[len(WRAPPER_PREFIX):] if fqn.startswith(WRAPPER_PREFIX) else fqn
        dtype = str(t.dtype).replace("torch.", "")
        if key in keys:
            spec[fqn] = {"source": "model", "key": key, "dtype": dtype}
        else:
            spec[fqn] = {"source": "extra", "key": fqn, "dtype": dtype}
            extra[fqn] = t.detach().cpu().contiguous()
    return {"constants": spec, "extra": extra}


@contextlib.contextmanager
def inductor_config_kept() -> Iterator[None]:
    """Put back every Inductor config value a compile changed, in place or not.

    `aoti_compile_and_package` fills `aot_inductor.metadata` in place (device key, CPU ISA) and leaves it
    so; that dict is part of the FX-graph cache key, so the compile route's cache, saved later in the
    same build, would hold graphs that no fresh process looks up (the runtime would miss and compile
    from scratch). `config.patch` does not help: it restores the same dict object."""
    config = torch._inductor.config
    before = {}
    for key, value in config.get_config_copy().items():
        try:
            before[key] = copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - a value that cannot be copied is compared by identity below
            before[key] = value
    try:
        yield
    finally:
        for key, value in config.get_config_copy().items():
            if key in before and value != before[key]:
                setattr(config, key, before[key])


def compiler_patch(compiler: Dict[str, Any]) -> Dict[str, Any]:
    """Inductor's config for compiling with `compiler` (`choose_compiler`'s): its C++ compiler where it is not
    Inductor's default (a package built by a compiler linking libstdc++ otherwise can end the process at load)."""
    return {} if compiler["cxx"] == _default_cxx() else {"cpp.cxx": (None, compiler["cxx"])}


def package(ep: ExportedProgram, out_dir: Path, checkpoint_keys: Iterable[str],
            cxx: Optional[str] = None, frozen: bool = False, max_autotune: bool = False,
            combo_kernels: bool = False) -> Dict[str, Any]:
    """Compile `ep` into `out_dir/model.pt2` plus its constants map; returns facts for the manifest.

    `frozen=True` instead folds the weights into the package (Inductor `freezing`): on the CPU that lets
    Inductor pre-pack them for oneDNN, which is what makes the package faster than eager per call on
    larger models (benchmarks/results/cpu.md); the price is a package the size of the weights.
    `max_autotune=True`: Inductor times its kernel choices here and compiles the winners in. Not a build setting:
    at either example batch the forward was no faster where its time goes and slower at one row, and Inductor's
    Triton GEMM templates lose to cuBLAS on this model's shapes and take neither the GeGLU nor the residual add
    into their epilogue where the time is (benchmarks/results/calls.md);
    `benchmarks/aoti_variants.py` keeps it measurable.
    `combo_kernels=True` (the GPU build): Inductor launches independent pointwise kernels as one; a short call's
    forward is set by its kernel count, and this took 4-6% off it at one row (benchmarks/results/calls.md).
    """
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    spec = constants_spec(ep, checkpoint_keys)
    compiler = choose_compiler(cxx)
    configs = ({"freezing": True, "aot_inductor.package_constants_in_so": True} if frozen
               else {"aot_inductor.package_constants_in_so": False})
    if max_autotune:
        configs["max_autotune"] = True
    if combo_kernels:
        configs["combo_kernels"] = True
    # compile under no_grad: Inductor pre-packs frozen weights for oneDNN only for inference graphs (the
    # frozen CPU package measured 225 ms at 1x128 compiled with grad mode on, 88 ms under no_grad)
    with (inductor_config_kept(), torch._inductor.config.patch(compiler_patch(compiler)), torch.no_grad(),
          attention_backends()):
        torch._inductor.aoti_compile_and_package(ep, package_path=str(out_dir / PACKAGE),
                                                 inductor_configs=configs)
    if frozen:
        unpack_library(out_dir)
    constants = {} if frozen else spec["constants"]
    (out_dir / CONSTANTS).write_text(json.dumps({"frozen": frozen, "constants": constants}, indent=1),
                                          encoding="utf-8")
    if spec["extra"] and not frozen:
        save_file(spec["extra"], str(out_dir / EXTRA))
    n_model = sum(1 for s in constants.values() if s["source"] == "model")
    shipped = out_dir / (LIBRARY if frozen else PACKAGE)
    return {"package_bytes": shipped.stat().st_size, "cxx": compiler["cxx"],
            "weights_inside": frozen, "unpacked": frozen,
            "cxx_passed_over": compiler["passed_over"],
            "constants_from_checkpoint": n_model, "constants_in_bundle": 0 if frozen else len(spec["extra"])}


def unpack_library(out_dir: Path) -> None:
    """Replace `out_dir/model.pt2` by the one shared library inside it, `out_dir/model.so`.

    torch's package loader extracts the whole zip into a fresh temporary directory on every load: for a frozen
    CPU package (the weights inside, 659 MB for base-512) that write cost 1.9 of the load's 2.2 s, holding the
    interpreter lock all along, while the library alone loads in 0.34 s (`load_aoti`). The zip's other members
    are the generated C++ sources (already compiled into the library) and metadata that `variant` checks
    from the manifest instead."""
    import shutil
    import zipfile

    pkg = out_dir / PACKAGE
    with zipfile.ZipFile(pkg) as z:
        libs = [n for n in z.namelist() if n.endswith(".so")]
        if len(libs) != 1:
            raise RuntimeError("the frozen AOTInductor package holds %d shared libraries (%s), expected one; "
                               "this torch packages differently: build with aoti.cpu_frozen=false"
                               % (len(libs), ", ".join(libs) or "none"))
        part = out_dir / (LIBRARY + ".part")
        with z.open(libs[0]) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 24)
    part.replace(out_dir / LIBRARY)
    pkg.unlink()


class AOTIRunner(Runner):
    """An AOTInductor package whose weights come from the checkpoint at load time."""

    def __init__(self, art_dir: Path, tensors: Mapping[str, torch.Tensor], device: str = "cpu",
                 cuda_graphs: bool = False,
                 prepared: Optional[Mapping[str, torch.Tensor] | Incoming | Callable[[], Any]] = None,
                 early_calls: Sequence[Sequence[torch.Tensor]] = (), rows: str = "padded"):
        from safetensors.torch import load_file

        art_dir = Path(art_dir)
        self.device = torch.device(device)
        # a package of packed rows (`export.rows=packed`) takes the collated batch too: it is packed here, on the host
        self.packed = rows == "packed"
        spec = json.loads((art_dir / CONSTANTS).read_text(encoding="utf-8"))
        t0 = time.perf_counter()
        self._compiled = load_aoti(art_dir, self._index())
        self.stats: Dict[str, object] = {"load_package_s": round(time.perf_counter() - t0, 3)}
        self._lock = threading.Lock()
        self._consts: Dict[str, torch.Tensor] = {}
        self._run = self._plain_run()
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda":
            from .graphs import GraphedCalls

            self.graphs = GraphedCalls(self._run, device=self.device)
        if spec.get("frozen"):  # weights folded into the package at build time
            return
        t0 = time.perf_counter()
        wanted = set(self._compiled.get_constant_fqns())
        missing = wanted - set(spec["constants"])
        if missing:
            raise KeyError("the package needs constants its constants.json does not describe: %s"
                           % sorted(missing)[:3])
        if callable(prepared):  # still on their way: the package's own load above ran beside their copy
            t_wait = time.perf_counter()
            prepared = prepared()
            self.stats["constants_wait_s"] = round(time.perf_counter() - t_wait, 3)
        incoming = prepared if isinstance(prepared, Incoming) else None
        if incoming is not None:  # allocated, maybe still being written: handed over now, read once written
            prepared = incoming.tensors
        if prepared is not None:  # read beside laya's load (`prepare`): only what this package takes is kept
            consts = {fqn: t for fqn, t in prepared.items() if fqn in wanted}
            self.stats["constants_prepared"] = True
        else:
            extra = load_file(str(art_dir / EXTRA)) if (art_dir / EXTRA).exists() else {}
            consts = device_constants(spec, extra, tensors, self.device, wanted)
        # user_managed: the package reads these tensors in place (no copy; bytes written later are what it reads)
        self._compiled.load_constants(consts, check_full_update=True, user_managed=True)
        self._consts = consts  # keep them alive
        self.stats["constants_s"] = round(time.perf_counter() - t0, 3)
        if incoming is not None:
            if not incoming.done:  # written now, after the hand-over (`Incoming`), beside the first call
                threading.Thread(target=incoming.fill, daemon=True, name="laya-aot-weights-fill").start()
                if early_calls:
                    self._early_calls(early_calls, consts)
            t_wait = time.perf_counter()
            incoming.wait()
            self.stats["constants_written_wait_s"] = round(time.perf_counter() - t_wait, 3)

    def _early_calls(self, batches: Sequence[Sequence[torch.Tensor]], consts: Mapping[str, torch.Tensor]) -> None:
        """Call the package on `batches` while its weights are still being written, outputs thrown away: what a
        first call loads lazily (kernel modules, cuBLAS) is paid beside the copy. Only where every constant is
        floating point: unwritten floats cannot make a kernel read out of bounds (integers may index), and the
        probe child runs the same package on unwritten weights (`synthetic_constants`) before this process
        loads it. A failure here is left to the smoke check, which calls it again once the weights are in."""
        if not all(t.is_floating_point() for t in consts.values()):
            self.stats["early_calls"] = "not made: a constant is not floating point"
            return
        t = time.perf_counter()
        where = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        try:
            with torch.no_grad(), where:
                for batch in batches:
                    self._run(*(x.to(self.device) for x in self._inputs(batch, None)))
            self.stats["early_calls"] = len(batches)
        except Exception as e:  # noqa: BLE001 - the smoke check (or the first call) reports a real failure
            log.debug("early call of the AOTInductor package failed: %s", e)
            self.stats["early_calls"] = "failed: %s" % type(e).__name__
        self.stats["early_calls_s"] = round(time.perf_counter() - t, 3)

    def _index(self) -> int:
        if self.device.type != "cuda":
            return -1
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def _plain_run(self) -> Callable[..., Outputs]:
        """The package's C++ `run` on a list of tensors: no pytree specs parsed on every call. Every input reaches
        the package here (a plain call, a CUDA graph's capture, an early call), made contiguous: the package reads
        each as laid out row after row, so a strided view (a transpose, a column slice) gave wrong answers without
        an error; `contiguous` returns a contiguous tensor itself."""
        loader = getattr(self._compiled, "loader", None)
        if loader is None or not hasattr(loader, "run"):
            return lambda *xs: tuple(self._compiled(*(x.contiguous() for x in xs)))
        return lambda *xs: tuple(loader.run([x.contiguous() for x in xs]))

    takes_host_inputs = True

    def __call__(self, ids, att, mpos, mmask, qtype) -> Outputs:
        """Inputs on any device, outputs on the inputs' device. A CUDA graph's replay takes host inputs straight
        into its static buffers and gives its outputs straight back: no device copy of either in between (on
        the H200 those copies were about a quarter of a 1x1 call's host time)."""
        back = ids.device
        inputs = self._inputs((ids, att, mpos, mmask, qtype), self.graphs)
        # the package launches on the current stream of the current device: make that the artifact's GPU,
        # whatever device the calling thread had current (an agent on cuda:1 beside one on cuda:0)
        where = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with self._lock, where:
            if self.graphs is not None:
                logits, act = self.graphs(*inputs, out_device=back)
            else:
                logits, act = self._run(*(x.to(self.device) for x in inputs))
                logits, act = logits.to(back), act.to(back)
        return logits, act

    def _inputs(self, batch: Sequence[torch.Tensor], graphs: Optional[Any]) -> Sequence[torch.Tensor]:
        """The package's inputs for a collated batch: itself, or its rows packed on the host (`modeling.packed`),
        the packed row's length stepped as the backend steps a call's (`padding.step_up`) where a CUDA graph may
        replay it, so that packed calls too take few shapes."""
        if not self.packed:
            return batch
        from ..modeling.packed import pack
        from ..padding import TOKEN_MULTIPLE, step_up

        batch = tuple(x.cpu() for x in batch)
        units = -(-max(1, int(batch[1].sum())) // TOKEN_MULTIPLE)
        stepped = step_up(units) * TOKEN_MULTIPLE
        multiple = stepped if graphs is not None and stepped <= graphs.max_tokens else TOKEN_MULTIPLE
        return pack(batch, 0, multiple)


def synthetic_constants(art_dir: Path, checkpoint: Path, device: str) -> Dict[str, torch.Tensor]:
    """Stand-in weights for an AOTInductor package: the checkpoint's shapes, read from the safetensors
    header only. The probe child only has to show that the package loads and runs on this machine without
    crashing; whether its answers are right is checked in-process (smoke check) with the real weights, so the
    child need not read gigabytes of them, nor write them: floating-point ones are left unwritten (filling a
    base-sized model's 656 MB took the child 0.3-1.2 s beside the service's own weight copy on two CPU cores);
    integer ones, which may index, are zeros."""
    from ..checkpoint import Weights

    spec = json.loads((Path(art_dir) / CONSTANTS).read_text(encoding="utf-8"))
    out: Dict[str, torch.Tensor] = {}
    weights = Weights(checkpoint)
    for src in spec.get("constants", {}).values():
        if src["source"] != "model":
            continue
        key = src["key"]
        dtype = getattr(torch, src["dtype"])
        make = torch.empty if dtype.is_floating_point else torch.zeros
        out[key] = make(weights.shape(key), dtype=dtype, device=device)
    return out


def _sources(spec: Dict[str, Any], tensors: Mapping[str, torch.Tensor], wanted: Optional[Iterable[str]]
             ) -> Tuple[Dict[str, Dict[str, str]], Dict[str, torch.dtype]]:
    """The constants to make (those in `wanted`; all that constants.json lists if None) and, of the checkpoint's
    tensors they come from, each one's dtype; a tensor the checkpoint lacks is refused here."""
    keep = None if wanted is None else set(wanted)
    chosen = {fqn: src for fqn, src in spec["constants"].items() if keep is None or fqn in keep}
    from_model = {src["key"]: getattr(torch, src["dtype"]) for src in chosen.values() if src["source"] == "model"}
    absent = sorted(k for k in from_model if k not in tensors)
    if absent:
        raise KeyError("the checkpoint has no tensor %r that this AOTInductor package needs; the bundle was built "
                       "from another model architecture" % absent[0])
    return chosen, from_model


def device_constants(spec: Dict[str, Any], extra: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor],
                     device: torch.device, wanted: Optional[Iterable[str]] = None) -> Dict[str, torch.Tensor]:
    """The package's constants on `device` (those in `wanted`; every one that constants.json lists if None),
    each taken from the checkpoint's `tensors` or the bundle's `extra` file and converted to its dtype there.
    Checkpoint tensors cross to the device in their stored dtype, once; to a GPU from a `checkpoint.Weights`, in a
    few large copies (`Weights.load_to`)."""
    chosen, from_model = _sources(spec, tensors, wanted)
    bulk = getattr(tensors, "load_to", None) if torch.device(device).type == "cuda" else None  # no copy to save
    loaded = bulk(from_model, device) if bulk is not None else {}
    consts: Dict[str, torch.Tensor] = {}
    for fqn, src in chosen.items():
        dtype = getattr(torch, src["dtype"])
        if src["source"] == "model" and src["key"] in loaded and loaded[src["key"]].dtype == dtype:
            consts[fqn] = loaded[src["key"]]
            continue
        t = tensors[src["key"]] if src["source"] == "model" else extra[fqn]
        # .to() returns the tensor itself when dtype and device already match (no second copy of the weights for
        # an fp32 CPU artifact)
        consts[fqn] = t.detach().to(device=device).to(dtype=dtype).contiguous()
    return consts


def incoming_constants(spec: Dict[str, Any], extra: Mapping[str, torch.Tensor], tensors: "Weights",
                       device: torch.device) -> Incoming:
    """`device_constants`' tensors allocated now, unwritten, and written by the returned `Incoming`'s `fill`:
    the package can take them (in place) while their bytes are still on their way."""
    chosen, from_model = _sources(spec, tensors, None)
    by_key = tensors.allocate(from_model, device)
    consts: Dict[str, torch.Tensor] = {}
    others = []  # constants not written by the bulk copy: the bundle's extras, a second dtype of one tensor
    for fqn, src in chosen.items():
        dtype = getattr(torch, src["dtype"])
        own = by_key.get(src["key"]) if src["source"] == "model" else None
        if own is not None and own.dtype == dtype:
            consts[fqn] = own
            continue
        shape = own.shape if own is not None else extra[fqn].shape
        consts[fqn] = torch.empty(tuple(shape), dtype=dtype, device=device)
        others.append((fqn, src))

    def fill() -> None:
        tensors.load_to(from_model, device, into=by_key)
        for fqn, src in others:
            consts[fqn].copy_(tensors[src["key"]] if src["source"] == "model" else extra[fqn])
        if torch.device(device).type == "cuda":  # written, whichever stream the reading thread then uses
            torch.cuda.synchronize(device)

    return Incoming(consts, fill)


def prepare(art_dir: Path, tensors: Mapping[str, torch.Tensor], device: str
            ) -> Optional[Dict[str, torch.Tensor] | Incoming]:
    """Every constant the package may take, on `device`, before the package itself is loaded: the loader
    runs this beside laya's load and the probe child (the package is not loaded in the service's process
    until the probe passed), so the weights' copy to the GPU is off a start's critical path. On a GPU, from a
    checkpoint's `Weights`: an `Incoming`, allocated but unwritten, that `AOTIRunner` hands to the package and
    then writes (`Incoming.fill`). None for a package with its weights inside."""
    from safetensors.torch import load_file

    art_dir = Path(art_dir)
    spec = json.loads((art_dir / CONSTANTS).read_text(encoding="utf-8"))
    if spec.get("frozen"):
        return None
    extra = load_file(str(art_dir / EXTRA)) if (art_dir / EXTRA).exists() else {}
    dev = torch.device(device)
    if dev.type == "cuda" and callable(getattr(tensors, "allocate", None)):
        return incoming_constants(spec, extra, tensors, dev)
    consts = device_constants(spec, extra, tensors, dev)
    if dev.type == "cuda":  # done when handed over, whichever stream the loading thread then uses
        torch.cuda.synchronize(dev)
    return consts


class _Package:
    """The C++ package loader with the three calls the runner makes, without torch's Python wrapper: importing
    that wrapper (`torch.export.pt2_archive._package`) pulls in torch._dynamo, 1-2 s of a start for nothing."""

    def __init__(self, loader: Any):
        self.loader = loader

    def get_constant_fqns(self) -> List[str]:
        return self.loader.get_constant_fqns()

    def load_constants(self, constants: Dict[str, torch.Tensor], check_full_update: bool,
                       user_managed: bool = False) -> None:
        try:  # torch >= 2.12 also takes allow_h2d_copy
            self.loader.load_constants(constants, False, check_full_update, user_managed, False)
        except TypeError:
            self.loader.load_constants(constants, False, check_full_update, user_managed)


class _Library:
    """A frozen CPU package's unpacked library (`unpack_library`): torch's container runner, no zip."""

    def __init__(self, runner: Any):
        self.loader = runner


def load_aoti(art_dir: Path, device_index: int):
    """The artifact's compiled model: its unpacked library where the build shipped one, else its package."""
    lib = Path(art_dir) / LIBRARY
    if lib.exists():
        make = getattr(getattr(torch._C, "_aoti", None), "AOTIModelContainerRunnerCpu", None)
        if device_index >= 0 or make is None:
            raise RuntimeError("%s is an unpacked CPU library; it loads only on the CPU, with torch's "
                               "AOTIModelContainerRunnerCpu: rebuild the bundle for this target" % lib)
        return _Library(make(str(lib), 1))
    return load_aoti_package(Path(art_dir) / PACKAGE, device_index)


def load_aoti_package(path: Path, device_index: int):
    """An AOTInductor package straight from torch's C++ package loader.

    `torch._inductor.package.load_package` first calls `codecache.get_device_information()`, only to log
    a warning when the build machine differs; that call dry-compiles a test library per CPU vector ISA
    and dlopens each in a child Python: tens of seconds of every load
    (35-48 s on an H200 host: benchmarks/results/starts.md). laya-aot checks that an artifact fits this machine itself
    (laya_aot.variant) before loading it, so it goes to the C++ loader directly, as that function
    does after its check; torch's own route remains the fallback for a torch without that binding.
    """
    make = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    if make is not None:
        try:
            # run_single_threaded=True: no per-call CUDA event bookkeeping in the container (AOTIRunner
            # serialises calls itself), which is also what lets a call be captured in a CUDA graph
            loader = make(str(path), "model", True, 1, device_index)
        except TypeError:  # another signature in this torch: use its public route
            loader = None
        if loader is not None:
            return _Package(loader)
    from torch._inductor.package import load_package

    return load_package(str(path), device_index=device_index)


def _package_gpu_first(program: ExportedProgram, staging: Path, name: str, keys: List[str], cxx: Optional[str],
                       device: str) -> Dict[str, Any]:
    """`staging/name`: a GPU package with combo kernels, or without them where Inductor cannot compile them for
    this model: combo kernels are a speed-up measured on this project's checkpoints, never a reason for a build
    to fail. `staging` is the build's own staging directory (`staging.staged`), so the failed try's files in it
    are removed here."""
    if device != "cuda":
        return package(program, staging / name, keys, cxx=cxx)
    try:
        return dict(package(program, staging / name, keys, cxx=cxx, combo_kernels=True), combo_kernels=True)
    except Exception as e:  # noqa: BLE001 - any compile failure of the newer lowering; the plain one decides
        why = one_line(e)
        log.warning("AOTInductor could not compile combo kernels for this model (%s); packaging without them", why)
        shutil.rmtree(staging / name, ignore_errors=True)
        return dict(package(program, staging / name, keys, cxx=cxx), combo_kernels=False, combo_kernels_refused=why)


def build(ctx: BuildContext, exported: Exported) -> Built:
    """The package for the target, weights not inside; on the CPU with `aoti.cpu_frozen` also the frozen one."""
    if ctx.device == "cuda" and not torch.cuda.is_available():
        raise Skip("target %s needs a %s GPU on the build machine to compile AOTInductor; none is visible "
                   "(run the build on a machine with that GPU)" % (ctx.cfg.target.name, ctx.cfg.target.arch))
    from ..checkpoint import Weights

    keys = list(Weights(ctx.ckpt))
    name = ctx.artifact_name(KIND)
    t0 = time.perf_counter()
    facts = dict(_package_gpu_first(exported.program, ctx.staging, name, keys, ctx.cfg.aoti.cxx, ctx.device),
                 **exported.details())
    ctx.add_artifact(KIND, name, name, ctx.device, ctx.dtype, time.perf_counter() - t0, details=facts,
                     precision=exported.precision)
    done = "package %.1f MB (weights not inside)" % (facts["package_bytes"] / 1e6)
    if ctx.device == "cpu" and ctx.cfg.aoti.cpu_frozen:
        t0 = time.perf_counter()
        frozen = dict(package(exported.program, ctx.staging / (name + "-frozen"), keys, cxx=ctx.cfg.aoti.cxx,
                              frozen=True), **exported.details())
        ctx.add_artifact(KIND, name + "-frozen", name + "-frozen", ctx.device, ctx.dtype, time.perf_counter() - t0,
                         details=frozen, precision=exported.precision)
        done += "; frozen package %.1f MB (weights inside, pre-packed)" % (frozen["package_bytes"] / 1e6)
    return Built(done)


def load(path: Path, art: Artifact, env: LoadEnv) -> Runner:
    return AOTIRunner(path, env.tensors or {}, env.device, env.cuda_graphs, env.prepared, env.early_calls,
                      str(art.details.get("rows", "padded")))


def probe_env(path: Path, art: Artifact, checkpoint: Path, device: str) -> LoadEnv:
    """Stand-in weights of the checkpoint's shapes (a crash does not depend on the values); CUDA graphs on,
    so the child also shows whether a capture works here."""
    return LoadEnv(device=device, tensors=synthetic_constants(path, checkpoint, device),
                   cuda_graphs=torch.device(device).type == "cuda")


KIND = Kind(name=NAME, stage="aoti", build=build, load=load, order=1, native=True, cuda_graphs=True,
            probe_env=probe_env, prepare=prepare, config_section="aoti")

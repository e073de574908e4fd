"""Run laya's TileLang fast path from precompiled kernels: no nvcc, no TileLang JIT.

`laya.fast.FastLaya` gets each kernel from a `laya.tl_kernels` factory (a TileLang `JITImpl`), which
calls `self.compile(...)` on a cache miss. This module gives those factories an instance-level
`compile` that, while a bundle is active in the calling context, loads the kernel from the bundle the
way TileLang loads its disk cache, or raises `KernelMissing`. FastLaya is thus reused unchanged, and
outside a bundle the factories JIT-compile as before. `make_fast_forward` and
`PrecompiledTileLangBackend` expose it as a forward and as a laya `Backend`.
"""
from __future__ import annotations

import atexit
import contextlib
import contextvars
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

from ..errors import LayaAotError, one_line
from ..files import sha256_file
from ..laya_internals import Backend, BackendUnavailable
from ..manifest import BundleError  # one error for "this bundle cannot be used here", kernels included
from .catalogue import FACTORIES, KernelSpec, encoder_dims, shape_specs
from .cross_compile import INDEX_NAME, META_FORMAT, cuda_target

log = logging.getLogger(__name__)

_ACTIVE: contextvars.ContextVar[Optional["KernelBundle"]] = contextvars.ContextVar("laya_aot_kernel_bundle",
                                                                                  default=None)
_HOOK_LOCK = threading.Lock()


class KernelMissing(LayaAotError, RuntimeError):
    """A kernel the fast path needs is not in the bundle (shape outside the export range, or a
    kernel that failed to compile for this architecture). Nothing is compiled instead."""




# ------------------------------------------------------------------------------------ architecture
def arch_of(capability: Tuple[int, int]) -> str:
    """TileLang's SM token for a compute capability: Hopper and newer get the 'a' suffix."""
    major, minor = capability
    return "sm_%d%d%s" % (major, minor, "a" if major >= 9 else "")


def detect_arch(device: Any = None) -> str:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: the TileLang fast path needs a GPU")
    return arch_of(torch.cuda.get_device_capability(device))


def select_arch(available: Iterable[str], capability: Tuple[int, int]) -> Optional[str]:
    """The best bundle arch for a GPU: exact match, else the newest same-major non-'a' arch below it
    (cubins are forward compatible within a major version; 'a' arches only run on their own chip)."""
    available = set(available)
    exact = arch_of(capability)
    if exact in available:
        return exact
    major, minor = capability
    fits = [a for a in available
            if a[-1].isdigit() and int(a[3:]) // 10 == major and int(a[3:]) % 10 <= minor]
    return max(fits, key=lambda a: int(a[3:])) if fits else None


# ------------------------------------------------------------------------------------ the bundle
def _arch_dir(kernels_dir: Path, arch: str) -> Path:
    """Accept either the build's out_dir (holding <arch>/) or the arch directory itself."""
    kernels_dir = Path(kernels_dir)
    return kernels_dir / arch if (kernels_dir / arch).is_dir() else kernels_dir


class KernelBundle:
    """The precompiled kernels of one architecture, loaded on demand and verified on load."""

    def __init__(self, kernels_dir: Path, arch: str, manifest_kernels: Optional[Sequence[Mapping[str, Any]]] = None,
                 verify: bool = True):
        self.arch = arch
        self.dir = _arch_dir(kernels_dir, arch)
        if manifest_kernels is None:
            index = self.dir / INDEX_NAME
            if not index.exists():
                raise BundleError("no manifest kernels given and no %s in %s" % (INDEX_NAME, self.dir))
            manifest_kernels = json.loads(index.read_text())["kernels"]
        self.entries: Dict[str, Mapping[str, Any]] = {e["key"]: e for e in manifest_kernels if e.get("status") == "ok"}
        self.failed: Dict[str, str] = {e["key"]: e.get("error") or "" for e in manifest_kernels
                                       if e.get("status") != "ok"}
        self.verify = verify
        self.loaded: Dict[str, Any] = {}
        self.loaded_in_background: set = set()   # keys `load_in_background` loaded
        self.load_seconds = 0.0
        self._lock = threading.Lock()
        # turns between the callers (a forward, a load on demand) and the background thread: no background load
        # starts while a caller is inside `foreground()`, and a caller entering waits for the one in flight
        self._turns = threading.Condition()
        self._callers = 0
        self._background_busy = False

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def specs(self) -> List[KernelSpec]:
        return [KernelSpec.from_json(e) for e in self.entries.values()]

    def _file(self, entry: Mapping[str, Any], path_key: str, sha_key: str) -> Path:
        path = self.dir / entry[path_key]
        if not path.exists():
            raise BundleError("kernel file %s is missing" % path)
        if self.verify and entry.get(sha_key) and sha256_file(path) != entry[sha_key]:
            raise BundleError("kernel file %s does not match its sha256 in the manifest" % path)
        return path

    def _read_meta(self, entry: Mapping[str, Any]) -> Dict[str, Any]:
        import laya
        import tilelang

        meta = json.loads(self._file(entry, "meta_path", "meta_sha256").read_text())
        if meta.get("format") != META_FORMAT or meta.get("arch") != self.arch:
            raise BundleError("%s: format %r / arch %r, expected %r / %r"
                              % (entry["key"], meta.get("format"), meta.get("arch"), META_FORMAT, self.arch))
        for name, have in (("tilelang_version", tilelang.__version__),
                           ("laya_version", getattr(laya, "__version__", "unknown"))):
            if meta.get(name) != have:
                raise BundleError("%s was built with %s %s, this process has %s: rebuild the bundle"
                                  % (entry["key"], name.split("_")[0], meta.get(name), have))
        return meta

    def _load_entry(self, entry: Mapping[str, Any]):
        """dlopen one kernel library and wrap it the way TileLang wraps a disk-cache hit."""
        from laya import tl_kernels
        from tilelang import tvm
        from tilelang.engine.param import load_kernel_params
        from tilelang.jit.adapter.base import CachedTextSource
        from tilelang.jit.kernel import JITKernel

        meta = self._read_meta(entry)
        lib = self._file(entry, "path", "sha256")
        impl = getattr(tl_kernels, meta["factory"])
        return JITKernel.from_database(
            func=tvm.ir.load_json(meta["signature"]), host_kernel_source=CachedTextSource(),
            device_kernel_source=CachedTextSource(), kernel_lib_path=str(lib),
            params=load_kernel_params(json.dumps(meta["params"])), target=cuda_target(self.arch), target_host=None,
            out_idx=meta["out_idx"], execution_backend=meta["execution_backend"],
            pass_configs=impl.pass_configs, compile_flags=impl.compile_flags)

    @contextlib.contextmanager
    def foreground(self) -> Iterator[None]:
        """While inside (re-entrant), no background load starts; entering waits for the one in flight (at most
        one kernel's load). A forward runs inside it, so no background load overlaps a call, its CUDA graph
        capture included, or competes with it for the interpreter."""
        with self._turns:
            self._callers += 1
            self._turns.wait_for(lambda: not self._background_busy)
        try:
            yield
        finally:
            with self._turns:
                self._callers -= 1
                self._turns.notify_all()

    def load(self, spec: KernelSpec):
        """The loaded kernel for `spec`; KernelMissing if the bundle does not have it."""
        with self.foreground():
            return self._load(spec.key, background=False)

    def load_in_background(self, spec: KernelSpec, stop: threading.Event) -> Optional[bool]:
        """Load `spec` when no caller is inside `foreground()`: True when this loaded it, False when a caller had
        meanwhile, None when `stop` was set first. Errors raise, and are not remembered: a caller that needs the
        kernel later loads it again and gets the error itself."""
        with self._turns:
            self._turns.wait_for(lambda: self._callers == 0 or stop.is_set())
            if stop.is_set():
                return None
            self._background_busy = True
        try:
            had = spec.key in self.loaded
            self._load(spec.key, background=True)
            return not had
        finally:
            with self._turns:
                self._background_busy = False
                self._turns.notify_all()

    def wake(self) -> None:
        """Let a background thread waiting for its turn see its stop event."""
        with self._turns:
            self._turns.notify_all()

    def _load(self, key: str, background: bool):
        with self._lock:
            if key in self.loaded:
                return self.loaded[key]
            entry = self.entries.get(key)
            if entry is None:
                why = ("it failed to compile for %s: %s" % (self.arch, self.failed[key].splitlines()[0][:500])
                       if key in self.failed else "it is not in the bundle's catalogue")
                raise KernelMissing("TileLang kernel %s is needed but %s (bundle %s). Nothing is compiled at run "
                                    "time: rebuild the bundle with a wider export range (max_rows/max_len) or "
                                    "use another backend." % (key, why, self.dir))
            t0 = time.perf_counter()
            kernel = self.loaded[key] = self._load_entry(entry)
            if background:
                self.loaded_in_background.add(key)
            self.load_seconds += time.perf_counter() - t0
            return kernel

    def loaded_in_foreground(self) -> int:
        """How many kernels callers loaded (construction and calls), as opposed to the background thread."""
        with self._lock:
            return len(self.loaded) - len(self.loaded_in_background)


# ------------------------------------------------------------------------------------ the hook
def _hook(impl, name: str) -> None:
    """Give one factory an instance-level `compile` that loads from the active bundle."""
    def compile_from_bundle(*args, **kwargs):
        bundle = _ACTIVE.get()
        if bundle is None:   # not ours: behave exactly as TileLang does (looked up now, not at hook time)
            return type(impl).compile(impl, *args, **kwargs)
        return bundle.load(KernelSpec.of(name, *args, **kwargs))

    impl.compile = compile_from_bundle
    impl._laya_aot_hooked = True


def install_hooks() -> None:
    """Idempotent; stays for the life of the process (inactive outside `active(bundle)`)."""
    from laya import tl_kernels

    with _HOOK_LOCK:
        for name in FACTORIES:
            impl = getattr(tl_kernels, name)
            if not getattr(impl, "_laya_aot_hooked", False):
                _hook(impl, name)


@contextlib.contextmanager
def active(bundle: "KernelBundle") -> Iterator[None]:
    """Within this context (this thread / task), kernel factories load from `bundle` or raise."""
    token = _ACTIVE.set(bundle)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


# ------------------------------------------------------------------------------------ the forward
class PrecompiledFast:
    """laya's FastLaya fed from a KernelBundle. `.forward` has DecisionModel.forward's signature.

    Every request is checked against the bundle before it reaches FastLaya, so a shape outside
    the export range fails with KernelMissing before any GPU work or CUDA-graph capture.

    Construction loads only the kernels FastLaya's constructor asks for, and a call the ones its shape needs
    (on demand, through the hooked factories). With `preload` the bundle's other kernels load in a thread
    started after construction (`Preload`), in the gaps between calls; `stats` says how many kernels were
    loaded before the first answer and what the background did.
    """

    def __init__(self, agent, bundle: KernelBundle, use_graphs: bool = True, preload: bool = True):
        import torch
        from laya.fast import FastLaya

        install_hooks()
        model = agent.model
        self.bundle = bundle
        self.dtype = agent.dtype if agent.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        self.max_len = int(agent.cfg.get("max_len", 512))
        self.dims = encoder_dims(model.encoder.config)
        self.head_layers = len(model.head.layers) if getattr(model, "head", None) is not None else 0
        self._served: set = set()
        t0 = time.perf_counter()
        with active(bundle), bundle.foreground():
            self.fast = FastLaya(model, max_len=self.max_len, use_graphs=use_graphs, dtype=self.dtype)
        self.init_seconds = time.perf_counter() - t0
        self.stats: Dict[str, Any] = {"kernels": len(bundle), "kernels_at_construction": len(bundle.loaded),
                                      "construction_s": round(self.init_seconds, 3),
                                      "kernels_before_first_answer": None,
                                      "preload": "background" if preload else "off"}
        self._first_call = True
        self.preload = Preload(bundle, self.stats) if preload else None
        log.info("TileLang fast path from %s: %d of %d kernels loaded for its construction (%.2f s), ready in %.2f s%s",
                 bundle.dir, len(bundle.loaded), len(bundle), bundle.load_seconds, self.init_seconds,
                 "; the others load in the background, between calls" if preload else "")

    def wait_preloaded(self, timeout: Optional[float] = None) -> bool:
        """Wait for the background preload (True: it ended, or there is none)."""
        return self.preload is None or self.preload.wait(timeout)

    def close(self) -> None:
        """Stop the background preload after the kernel it is loading (kernels loaded stay)."""
        if self.preload is not None:
            self.preload.stop()

    def __del__(self) -> None:
        preload = getattr(self, "preload", None)
        if preload is not None:
            preload.stop()

    def required(self, n_rows: int, n_tokens: int) -> List[KernelSpec]:
        return shape_specs(self.dims, str(self.dtype), n_rows, n_tokens, self.max_len, self.head_layers)

    def check(self, n_rows: int, n_tokens: int) -> None:
        """Raise KernelMissing unless the bundle serves this request; memoised per padded shape,
        because on small shapes the fast path is CPU-bound and per-call Python shows in latency."""
        from laya.backends.base import bucket_rows, bucket_tokens

        if n_tokens > self.max_len:
            raise KernelMissing("request of %d tokens exceeds the checkpoint's max_len %d" % (n_tokens, self.max_len))
        padded = (bucket_rows(n_rows), bucket_tokens(n_tokens, self.max_len))
        if padded in self._served:
            return
        missing = [s.key for s in self.required(n_rows, n_tokens) if s.key not in self.bundle]
        if missing:
            raise KernelMissing("a request of %d rows x %d tokens needs kernels the bundle (%s) lacks: %s. Nothing "
                                "is compiled at run time; rebuild with a larger max_rows or split the batch."
                                % (n_rows, n_tokens, self.bundle.dir, ", ".join(missing)))
        self._served.add(padded)

    def forward(self, input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder=False):
        self.check(int(input_ids.shape[0]), int(input_ids.shape[1]))
        with active(self.bundle), self.bundle.foreground():
            out = self.fast.forward(input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder)
        if self._first_call:
            self._first_call = False
            self.stats["kernels_before_first_answer"] = self.bundle.loaded_in_foreground()
        return out

    __call__ = forward


# background preloads still running, stopped at interpreter exit (after the kernel each is loading)
_RUNNING: set = set()
_RUNNING_LOCK = threading.Lock()
_RUNNING_ATEXIT: List[bool] = []   # the exit hook, registered with the first preload


def _stop_running() -> None:
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for p in running:
        p.stop()
    for p in running:
        p.wait(5.0)


class Preload:
    """The bundle's kernels nobody has loaded yet, loaded in a daemon thread (`bundle.load_in_background`:
    only while no call is in flight). Loads go to the bundle, not through TileLang's factories, whose
    Python-level call caches are not made for two threads; a call's factory then finds its kernel loaded.
    A kernel that fails here is recorded in `stats["background_failed"]` and logged; a call that needs it
    loads it again and raises the error, as a load on demand does. Updates `stats` (the runner's) in place."""

    def __init__(self, bundle: KernelBundle, stats: Dict[str, Any]):
        self.bundle, self.stats = bundle, stats
        self._stop = threading.Event()
        stats.update(background="running", background_kernels=0, background_s=None, background_failed={})
        self.thread = threading.Thread(target=self._run, daemon=True, name="laya-aot-tilelang-preload")
        with _RUNNING_LOCK:
            if not _RUNNING_ATEXIT:
                atexit.register(_stop_running)
                _RUNNING_ATEXIT.append(True)
            _RUNNING.add(self)
        self.thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        bundle, failed, done, stopped = self.bundle, {}, 0, False
        try:
            with active(bundle):   # this thread's own context: what a factory called from here would load from
                for spec in bundle.specs():
                    if spec.key in bundle.loaded:
                        continue
                    try:
                        loaded = bundle.load_in_background(spec, self._stop)
                        if loaded is None:
                            stopped = True
                            break
                        done += loaded
                    except Exception as e:  # noqa: BLE001 - recorded; a call that needs it raises it again
                        failed[spec.key] = one_line(e)
        except Exception as e:  # noqa: BLE001 - never the process's end; calls still load on demand
            failed["(preload)"] = one_line(e)
        finally:
            seconds = time.perf_counter() - t0
            self.stats.update(background="stopped" if stopped else "done", background_kernels=done,
                              background_s=round(seconds, 3), background_failed=failed)
            with _RUNNING_LOCK:
                _RUNNING.discard(self)
        if failed:
            log.warning("laya-aot: %d TileLang kernel(s) of %s failed to load in the background (a call that needs "
                        "one raises its error): %s", len(failed), bundle.dir,
                        "; ".join("%s: %s" % kv for kv in list(failed.items())[:3]))
        first = self.stats.get("kernels_before_first_answer")
        log.info("laya-aot: %d TileLang kernels of %s loaded in the background in %.2f s%s (%s)", done, bundle.dir,
                 seconds, ", then stopped" if stopped else "",
                 "no call yet" if first is None else "%d were loaded before the first answer" % first)

    def stop(self) -> None:
        self._stop.set()
        self.bundle.wake()

    def wait(self, timeout: Optional[float] = None) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()


def make_fast_forward(agent, kernels_dir: Path, arch: Optional[str] = None,
                      manifest_kernels: Optional[Sequence[Mapping[str, Any]]] = None, use_graphs: bool = True,
                      preload: bool = True, verify: bool = True) -> PrecompiledFast:
    """laya's fast path for `agent` running only the bundle's kernels for `arch`.

    kernels_dir: the directory build_for_checkpoint wrote (holding <arch>/), or the arch dir.
    arch: e.g. "sm_90a"; None detects the local GPU's.
    manifest_kernels: the "kernels" list compile_catalogue returned (None reads kernels.json).
    preload: load the kernels construction did not in a background thread, between calls (else on demand).
    Raises KernelMissing if a kernel FastLaya needs at construction is absent, BundleError if one of
    those kernels' files is missing/altered or the bundle was built with another TileLang/laya (any other
    kernel raises so when a call needs it).
    """
    bundle = KernelBundle(kernels_dir, arch or detect_arch(), manifest_kernels, verify=verify)
    return PrecompiledFast(agent, bundle, use_graphs=use_graphs, preload=preload)


class PrecompiledTileLangBackend(Backend):
    """laya Backend contract around PrecompiledFast (`backend.install()` swaps model.forward).

    Unlike laya's "tilelang" backend it never compiles: a missing kernel or bundle is
    BackendUnavailable at install (so the caller falls back), KernelMissing per request.
    """

    name = "tilelang-aot"

    def __init__(self, agent, kernels_dir: Path, arch: Optional[str] = None,
                 manifest_kernels: Optional[Sequence[Mapping[str, Any]]] = None, use_graphs: bool = True,
                 preload: bool = True):
        super().__init__(agent)
        self.kernels_dir, self.arch, self.manifest_kernels = Path(kernels_dir), arch, manifest_kernels
        self.use_graphs, self.preload = use_graphs, preload
        self.runner: Optional[PrecompiledFast] = None
        self.fast = None

    def _install(self) -> None:
        import torch

        agent = self.agent
        if agent.device.type != "cuda":
            raise BackendUnavailable("needs a CUDA device")
        if agent.dtype not in (torch.bfloat16, torch.float16):
            raise BackendUnavailable("the TileLang kernels need bf16 or fp16 and the agent runs %s" % (agent.dtype,))
        try:
            self.runner = make_fast_forward(agent, self.kernels_dir, self.arch, self.manifest_kernels,
                                            use_graphs=self.use_graphs, preload=self.preload)
        except (KernelMissing, BundleError, ImportError, ValueError) as e:
            raise BackendUnavailable(str(e)) from e
        self.fast = self.runner.fast
        self.max_len = self.runner.max_len

    def _uninstall(self) -> None:
        if self.runner is not None:
            self.runner.close()
        self.runner = self.fast = None

    def forward(self, input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder=False):
        return self.runner.forward(input_ids, attention_mask, marker_pos, marker_mask, qtype, detach_encoder)

    def warmup(self, shapes=None) -> float:
        return self.agent.warmup(shapes)


__all__ = ["BundleError", "KernelBundle", "KernelMissing", "PrecompiledFast", "PrecompiledTileLangBackend", "Preload",
           "active", "arch_of", "detect_arch", "install_hooks", "make_fast_forward", "select_arch"]

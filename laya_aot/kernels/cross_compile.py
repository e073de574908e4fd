"""Cross-compile a kernel catalogue for one GPU architecture, on a machine with nvcc and no GPU.

Each kernel becomes `<key>.so` (TileLang's TVM-FFI library: host launcher plus device cubin) and
`<key>.json` (spec, kernel params and the body-less PrimFunc signature), both hashed, so the runtime
neither elaborates nor lowers anything; a failing kernel records the compiler's message. Compilation
runs in a thread pool (nvcc is a subprocess and lowering releases the GIL; one TileLang import), with
`ast.parse` serialised (`astlock`). TileLang's caches are disabled so every kernel really compiles
and nothing leaks into ~/.tilelang.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

from ..checkpoint import ENCODER_CONFIG, read_config
from ..files import cache_dir, parse_cache_json, read_cache_bytes, sha256_file, write_bytes_atomic
from .astlock import serial_ast_parse
from .catalogue import KernelSpec, catalogue

log = logging.getLogger(__name__)

DEFAULT_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a")
META_FORMAT = 1
INDEX_NAME = "kernels.json"
_ERROR_LIMIT = 20000


def cuda_target(arch: str) -> Dict[str, str]:
    """TileLang's target for an SM token; the arch is exact (sm_90a, not sm_90, for wgmma/TMA)."""
    if not re.fullmatch(r"sm_\d+[af]?", arch):
        raise ValueError("arch must be an SM token such as 'sm_86' or 'sm_90a', got %r" % arch)
    return {"kind": "cuda", "arch": arch}


def find_nvcc() -> Path:
    """The nvcc TileLang will call: its CUDA_HOME (env, PATH, pip nvidia-cuda-nvcc, /usr/local/cuda)."""
    from tilelang import env as tl_env

    home = tl_env.CUDA_HOME
    nvcc = Path(home) / "bin" / "nvcc" if home else None
    if nvcc is None or not nvcc.exists():
        raise RuntimeError("nvcc not found (TileLang's CUDA_HOME=%r). Install the CUDA toolkit, or "
                           "`pip install nvidia-cuda-nvcc>=13.0`, or set CUDA_HOME." % home)
    return nvcc


def nvcc_version(nvcc: Optional[Path] = None) -> str:
    out = subprocess.run([str(nvcc or find_nvcc()), "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release [\d.]+, V([\d.]+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def _versions() -> Dict[str, str]:
    import laya
    import tilelang

    return {"tilelang_version": tilelang.__version__, "laya_version": getattr(laya, "__version__", "unknown")}


_BUILD_ENV = {"TILELANG_DISABLE_CACHE": "1",          # every kernel really compiles; nothing leaks into ~/.tilelang
              "TILELANG_PRINT_ON_COMPILATION": "0"}   # one log line per kernel would drown the progress bar


@contextlib.contextmanager
def _build_env() -> Iterator[None]:
    """TileLang reads these from os.environ on each use, so setting them for the build suffices."""
    old = {k: os.environ.get(k) for k in _BUILD_ENV}
    os.environ.update(_BUILD_ENV)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _factory(name: str):
    from laya import tl_kernels

    return getattr(tl_kernels, name)


def elaborate(spec: KernelSpec):
    """The PrimFunc laya's factory builds for this spec (Python tracing only, no compile)."""
    return _factory(spec.factory).get_tir(**spec.kwargs)


def _signature_json(func) -> str:
    """The PrimFunc with its body replaced: params, buffer map and attrs, a few kB of JSON."""
    from tilelang import tvm
    from tvm import tirx

    return tvm.ir.save_json(func.with_body(tirx.Evaluate(0)))


def _compile_one(spec: KernelSpec, func, arch: str, out_dir: Path) -> Dict[str, Any]:
    """Lower + nvcc one kernel, export its library and metadata; raise on any failure."""
    import tilelang
    from tilelang.engine.param import dump_kernel_params

    impl = _factory(spec.factory)
    kernel = tilelang.compile(func, out_idx=impl.out_idx, execution_backend="tvm_ffi", target=cuda_target(arch),
                              pass_configs=impl.pass_configs, compile_flags=impl.compile_flags)
    lib = out_dir / (spec.key + ".so")
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        staged = Path(tmp) / "k.so"
        kernel.adapter.get_exportable_executable().export_library(str(staged))
        os.replace(staged, lib)
    meta = {"format": META_FORMAT, "key": spec.key, **spec.to_json(), "arch": arch,
            "execution_backend": "tvm_ffi", "out_idx": impl.out_idx,
            "params": json.loads(dump_kernel_params(kernel.params)), "signature": _signature_json(func),
            **_versions()}
    meta_path = out_dir / (spec.key + ".json")
    write_bytes_atomic(meta_path, json.dumps(meta, indent=1, sort_keys=True).encode())
    return {"path": lib.name, "sha256": sha256_file(lib), "size": lib.stat().st_size,
            "meta_path": meta_path.name, "meta_sha256": sha256_file(meta_path)}


def compiler_message(exc: BaseException) -> str:
    """The compiler's own words, first. TileLang's nvcc errors carry the whole generated source
    before the compiler output, so keep the error lines, then nvcc's output (tail), not the source."""
    text = str(exc)
    _, found, output = text.partition("Compilation error:")
    body = (output if found else text).strip()
    errors = [line.strip() for line in body.splitlines() if re.search(r"\berror\b", line, re.IGNORECASE)]
    summary = "\n".join(errors[:20]) if errors else (body.splitlines()[0] if body else "")
    message = "%s: %s" % (type(exc).__name__, summary)
    if found:
        message += "\n--- compiler output (tail) ---\n" + body[-_ERROR_LIMIT:]
    return message


def _entry(spec: KernelSpec) -> Dict[str, Any]:
    return {"key": spec.key, **spec.to_json(), "path": None, "sha256": None, "size": None,
            "meta_path": None, "meta_sha256": None, "status": "failed", "error": None, "seconds": 0.0}


def kernel_cache_dir(arch: str, nvcc: str) -> Optional[Path]:
    """Where compiled kernels are kept between builds, per arch and tool versions; None when disabled.

    $LAYA_AOT_KERNEL_CACHE (or the laya-aot cache dir's tilelang-kernels/); "0" or "" disables it.
    A kernel's key is a hash of its factory call, so a hit is the same kernel compiled earlier by the
    same TileLang, laya and nvcc for the same arch: a GPU build host can reuse what a CPU CI job compiled.
    """
    root = os.environ.get("LAYA_AOT_KERNEL_CACHE")
    if root is not None and root.strip() in ("", "0"):
        return None
    if root is None:
        root = str(cache_dir() / "tilelang-kernels")
    v = _versions()
    return Path(root) / ("tilelang%s-laya%s-nvcc%s" % (v["tilelang_version"], v["laya_version"], nvcc)) / arch


# the largest compiled kernel the kernel cache hands back (one kernel's library is well under a MiB)
MAX_KERNEL_BYTES = 256 << 20


def _from_cache(spec: KernelSpec, cache: Optional[Path], out_dir: Path) -> Optional[Dict[str, Any]]:
    """Copy a cached kernel into out_dir; None on a miss (or a cache entry that does not read back)."""
    if cache is None:
        return None
    lib, meta = cache / (spec.key + ".so"), cache / (spec.key + ".json")
    # read as any cache entry is (`files.read_cache_bytes`): regular files of a bounded size, the record this key's
    data_meta = read_cache_bytes(meta)
    record = parse_cache_json(data_meta, {"key": str}, meta) if data_meta is not None else None
    data_lib = read_cache_bytes(lib, MAX_KERNEL_BYTES) if record is not None and record["key"] == spec.key else None
    if data_meta is None or data_lib is None:
        return None
    write_bytes_atomic(out_dir / lib.name, data_lib)
    write_bytes_atomic(out_dir / meta.name, data_meta)
    return {"path": lib.name, "sha256": sha256_file(out_dir / lib.name), "size": len(data_lib),
            "meta_path": meta.name, "meta_sha256": sha256_file(out_dir / meta.name), "cached": True}


def _to_cache(files: Dict[str, Any], cache: Optional[Path], out_dir: Path) -> None:
    if cache is None:
        return
    try:
        cache.mkdir(parents=True, exist_ok=True)
        for name in (files["path"], files["meta_path"]):
            write_bytes_atomic(cache / name, (out_dir / name).read_bytes())
    except OSError as e:  # a read-only cache only costs the next build time
        log.debug("kernel cache not written: %s", e)


def _run_one(spec: KernelSpec, func, arch: str, out_dir: Path, cache: Optional[Path] = None) -> Dict[str, Any]:
    entry = _entry(spec)
    t0 = time.perf_counter()
    try:
        hit = _from_cache(spec, cache, out_dir)
        if hit is not None:
            entry.update(hit, status="ok")
            entry["seconds"] = round(time.perf_counter() - t0, 3)
            return entry
        if func is None:  # skipped up front as a cache hit, but the entry did not read back
            func = elaborate(spec)
        if isinstance(func, BaseException):
            raise func
        files = _compile_one(spec, func, arch, out_dir)
        _to_cache(files, cache, out_dir)
        entry.update(files, status="ok", cached=False)
    except Exception as e:  # the compiler's message goes into the report; the build goes on
        entry["error"] = compiler_message(e)
        log.warning("kernel %s failed for %s: %s", spec.key, arch, entry["error"].splitlines()[0][:300])
    entry["seconds"] = round(time.perf_counter() - t0, 3)
    return entry


def default_jobs() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def compile_catalogue(specs: Sequence[KernelSpec], arch: str, out_dir: Path, jobs: Optional[int] = None,
                      progress: bool = True) -> Dict[str, Any]:
    """Compile `specs` for `arch` into `out_dir`; needs nvcc, not a GPU.

    Returns {"arch", "target", "kernels": [{"key", "factory", "kwargs", "path", "sha256", "size",
    "meta_path", "meta_sha256", "status": "ok"|"failed", "error", "seconds"}], "seconds",
    "tilelang_version", "laya_version", "nvcc_version", "jobs", "ok", "failed"}; paths are
    relative to out_dir. The same dict is written to out_dir/kernels.json.
    """
    from .. import progress as live

    target = cuda_target(arch)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = list(dict.fromkeys(specs))
    jobs = max(1, jobs or default_jobs())
    nvcc = find_nvcc()
    nvcc_v = nvcc_version(nvcc)
    cache = kernel_cache_dir(arch, nvcc_v)
    t0 = time.perf_counter()
    funcs: List[Any] = []
    for spec in specs:
        if cache is not None and (cache / (spec.key + ".so")).exists():
            funcs.append(None)  # a cache hit needs no PrimFunc
            continue
        try:
            funcs.append(elaborate(spec))
        except Exception as e:  # recorded per kernel by _run_one
            funcs.append(e)
    results: Dict[str, Dict[str, Any]] = {}
    with _build_env(), serial_ast_parse(), ThreadPoolExecutor(jobs, thread_name_prefix="tl-aot") as pool, \
            (live.task("tilelang %s: kernels" % arch, total=len(specs)) if progress else contextlib.nullcontext(
                live.Task())) as bar:
        futures = {pool.submit(_run_one, s, f, arch, out_dir, cache): s for s, f in zip(specs, funcs)}
        for fut in as_completed(futures):
            entry = fut.result()
            results[entry["key"]] = entry
            failed = sum(e["status"] != "ok" for e in results.values())
            if failed:
                bar.describe("tilelang %s: kernels (%d failed)" % (arch, failed))
            bar.advance()
    kernels = [results[s.key] for s in specs]
    n_ok = sum(e["status"] == "ok" for e in kernels)
    n_cached = sum(bool(e.get("cached")) for e in kernels)
    report = {"arch": arch, "target": target, "kernels": kernels, "seconds": round(time.perf_counter() - t0, 3),
              **_versions(), "nvcc_version": nvcc_v, "jobs": jobs, "ok": n_ok,
              "failed": len(kernels) - n_ok, "from_cache": n_cached, "cache": str(cache) if cache else None}
    write_bytes_atomic(out_dir / INDEX_NAME, json.dumps(report, indent=1).encode())
    log.info("compiled %d/%d kernels for %s in %.1f s (%d jobs, %d from the kernel cache)", n_ok, len(kernels), arch,
             report["seconds"], jobs, n_cached)
    return report


def read_checkpoint_config(checkpoint_dir: Path) -> Dict[str, Any]:
    """encoder/config.json and rl_agent_config.json of a Laya checkpoint directory."""
    return {"encoder": read_config(checkpoint_dir, ENCODER_CONFIG), "agent": read_config(checkpoint_dir)}


def checkpoint_catalogue(checkpoint_dir: Path, dtype: Optional[str] = None, max_len: Optional[int] = None,
                         max_rows: int = 64) -> List[KernelSpec]:
    """The catalogue of a checkpoint directory; dtype defaults to what laya serves it in on a GPU of sm_80 or
    newer (its amp_dtype, fp16 when absent), max_len to its own config."""
    from ..numerics.precision import cuda_dtype

    cfg = read_checkpoint_config(checkpoint_dir)
    agent = cfg["agent"]
    return catalogue(cfg["encoder"], dtype or cuda_dtype(agent.get("amp_dtype")), max_len or agent.get("max_len", 512),
                     max_rows, head_layers=int(agent.get("head_layers", 2)))


def build_for_checkpoint(checkpoint_dir: Path, archs: Sequence[str], dtype: str, max_len: int, max_rows: int,
                         out_dir: Path, jobs: Optional[int] = None, progress: bool = True) -> Dict[str, Dict[str, Any]]:
    """Compile a checkpoint's catalogue for each arch into out_dir/<arch>/; {arch: report}."""
    specs = checkpoint_catalogue(checkpoint_dir, dtype, max_len, max_rows)
    out_dir = Path(out_dir)
    reports = {}
    for arch in archs:
        reports[arch] = compile_catalogue(specs, arch, out_dir / arch, jobs=jobs, progress=progress)
    return reports


__all__ = ["DEFAULT_ARCHS", "build_for_checkpoint", "kernel_cache_dir", "checkpoint_catalogue", "compile_catalogue",
           "cuda_target", "find_nvcc", "nvcc_version", "read_checkpoint_config"]

"""Stage c: AOTInductor package for the target, with the weights kept out of the package.

`aot_inductor.package_constants_in_so=False` makes the package a few MB instead of the model's size,
so a bundle for N architectures does not carry N copies of the weights. `constants.json` beside the
package says where each constant comes from at load time: a tensor of the checkpoint's
model.safetensors (converted to the dtype it names) or, for the few tensors a checkpoint does not
hold (RoPE frequencies, lifted constants), `extra_constants.safetensors`.
"""
from __future__ import annotations

import contextlib
import copy
import glob
import json
import logging
import os
import shutil
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional

import torch
from torch.export import ExportedProgram

from ..runtime.runners import AOTI_CONSTANTS, AOTI_EXTRA, AOTI_PACKAGE

log = logging.getLogger(__name__)

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


def links_libstdcxx_dynamically(cxx: str) -> bool:
    """Whether `cxx` links libstdc++ as a shared library.

    A compiler that cannot find libstdc++.so links it statically into the package's wrapper .so, which
    then holds a second copy of libstdc++ beside the one torch loaded; the two disagree on std::locale's
    facets and the loader segfaults in std::regex (AOTInductorModel -> parse_device_str). That is the
    crash every AOTInductor load hit on the H200 image, whose default g++ is such a wrapper
    (benchmarks/results/aoti_h200_load_crash.md).
    """
    try:
        out = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                             timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return False
    if not (os.path.isabs(out) and os.path.exists(out)):
        return False
    needed = _needed_by_a_test_library(cxx)
    return True if needed is None else any(n.startswith("libstdc++.so") for n in needed)


def _needed_by_a_test_library(cxx: str) -> Optional[List[str]]:
    """NEEDED entries of a one-line shared library `cxx` links (a wrapper may add -static-libstdc++);
    None when that cannot be checked here (no readelf, or the compile itself fails)."""
    readelf = shutil.which("readelf")
    if readelf is None:
        return None
    with tempfile.TemporaryDirectory(prefix="laya-aot-cxx-") as tmp:
        src, lib = os.path.join(tmp, "t.cpp"), os.path.join(tmp, "t.so")
        with open(src, "w", encoding="utf-8") as f:
            f.write('#include <string>\nextern "C" int laya_aot_probe(const char* s) { return std::string(s).size(); }\n')
        try:
            subprocess.run([cxx, "-shared", "-fPIC", "-O0", src, "-o", lib], capture_output=True, timeout=60,
                           check=True)
            dyn = subprocess.run([readelf, "-d", lib], capture_output=True, text=True, timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)


def _default_cxx() -> Optional[str]:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return get_cpp_compiler()
    except Exception:  # noqa: BLE001 - torch without a resolvable compiler
        return shutil.which("g++")


def candidate_compilers(configured: Optional[str] = None) -> List[str]:
    """The configured compiler, torch's default, then the system g++ builds, without duplicates."""
    names = [configured, _default_cxx(), shutil.which("g++"), "/usr/bin/g++"]
    names += sorted(glob.glob("/usr/bin/x86_64-linux-gnu-g++-*") + glob.glob("/usr/bin/g++-*"), reverse=True)
    seen, out = set(), []
    for n in names:
        if n and os.path.exists(n) and os.path.realpath(n) not in seen:
            seen.add(os.path.realpath(n))
            out.append(n)
    return out


def choose_compiler(configured: Optional[str] = None) -> Dict[str, Any]:
    """The first compiler that links libstdc++ dynamically, and why the others were passed over."""
    if configured and not os.path.exists(configured):
        raise FileNotFoundError("aoti.cxx=%s does not exist; give the path of a C++ compiler" % configured)
    passed_over = []
    for cxx in candidate_compilers(configured):
        if links_libstdcxx_dynamically(cxx):
            return {"cxx": cxx, "passed_over": passed_over}
        passed_over.append("%s cannot link libstdc++ dynamically (its packages crash on load)" % cxx)
    log.warning("no C++ compiler here links libstdc++ dynamically; AOTInductor packages may crash on load: %s",
                "; ".join(passed_over))
    return {"cxx": configured or _default_cxx(), "passed_over": passed_over}


@contextlib.contextmanager
def inductor_config_kept() -> Iterator[None]:
    """Put back every Inductor config value a compile changed, in place or not.

    `aoti_compile_and_package` fills `aot_inductor.metadata` in place (device key, CPU ISA) and leaves it
    so; that dict is part of the FX-graph cache key, so the compile route's cache, saved later in the
    same build, held graphs that no fresh process looks up: on the H200 (run 10) the runtime missed and
    compiled from scratch for 42 s. `config.patch` does not help: it restores the same dict object."""
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


def package(ep: ExportedProgram, out_dir: Path, checkpoint_keys: Iterable[str],
            cxx: Optional[str] = None, frozen: bool = False) -> Dict[str, Any]:
    """Compile `ep` into `out_dir/model.pt2` plus its constants map; returns facts for the manifest.

    `frozen=True` instead folds the weights into the package (Inductor `freezing`): on the CPU that lets
    Inductor pre-pack them for oneDNN, which is what makes the package faster than eager per call on
    larger models (benchmarks/results/cpu_base-512.md); the price is a package the size of the weights.
    """
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    spec = constants_spec(ep, checkpoint_keys)
    compiler = choose_compiler(cxx)
    configs = ({"freezing": True, "aot_inductor.package_constants_in_so": True} if frozen
               else {"aot_inductor.package_constants_in_so": False})
    # compile under no_grad: Inductor pre-packs frozen weights for oneDNN only for inference graphs (the
    # frozen CPU package measured 225 ms at 1x128 compiled with grad mode on, 88 ms under no_grad)
    patch = {} if compiler["cxx"] == _default_cxx() else {"cpp.cxx": (None, compiler["cxx"])}
    with inductor_config_kept(), torch._inductor.config.patch(patch), torch.no_grad():
        torch._inductor.aoti_compile_and_package(ep, package_path=str(out_dir / AOTI_PACKAGE),
                                                 inductor_configs=configs)
    constants = {} if frozen else spec["constants"]
    (out_dir / AOTI_CONSTANTS).write_text(json.dumps({"frozen": frozen, "constants": constants}, indent=1),
                                          encoding="utf-8")
    if spec["extra"] and not frozen:
        save_file(spec["extra"], str(out_dir / AOTI_EXTRA))
    n_model = sum(1 for s in constants.values() if s["source"] == "model")
    return {"package_bytes": (out_dir / AOTI_PACKAGE).stat().st_size, "cxx": compiler["cxx"],
            "weights_inside": frozen,
            "cxx_passed_over": compiler["passed_over"],
            "constants_from_checkpoint": n_model, "constants_in_bundle": 0 if frozen else len(spec["extra"])}

"""Which C++ compiler packages AOTInductor: never one that links libstdc++ statically (its packages crash on load)."""
from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any, Dict, List, Optional

log = logging.getLogger(__name__)


def links_libstdcxx_dynamically(cxx: str) -> bool:
    """Whether `cxx` links libstdc++ as a shared library.

    A compiler that cannot find libstdc++.so links it statically into the package's wrapper .so, which
    then holds a second copy of libstdc++ beside the one torch loaded; the two disagree on std::locale's
    facets and the loader segfaults in std::regex (AOTInductorModel -> parse_device_str). Some images'
    default g++ is such a wrapper: on one GPU host's image every package it built died at load.
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
            f.write('#include <string>\n'
                    'extern "C" int laya_aot_probe(const char* s) { return std::string(s).size(); }\n')
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

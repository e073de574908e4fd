"""The aoti kind's settings, the build config's `aoti` section (`aoti.cxx=g++-12`).

Kept apart from `aoti.py` because the build schema (`config.py`) composes it and `laya-aot build` checks
overrides against that schema before torch is imported: this module imports neither torch nor anything of
the package (`tests/project/test_architecture.py` checks it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class AotiConfig:
    """The aoti kind's settings: AOTInductor packaging. `cxx` null = the first compiler here that links
    libstdc++ dynamically (torch's default first); a statically linked libstdc++ makes packages crash on load."""

    cxx: Optional[str] = None
    # true: CPU targets also get a package with the weights frozen inside (Inductor pre-packs them for oneDNN).
    # Off by default: slower than `aoti-cpu` at one row on the tiny demo, 0.62-0.92x its time on base-512, and a
    # package the size of the weights in a bundle that otherwise holds none (benchmarks/results/cpu.md)
    cpu_frozen: bool = False

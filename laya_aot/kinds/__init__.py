"""The artifact kinds, registered in one table (`registry.py`): the pipeline builds them, the loader asks them.

Adding a kind: write `kinds/<stage>.py` with its build step, its runner and its `KIND` facts, its own build
settings (if any) in `kinds/<stage>_settings.py`, and add it to `registry.REGISTRY` (docs/architecture.md
walks through it). Nothing else names a kind.

Importing this package imports no torch: the registry and `base`'s names (which do) load on first use
(`kinds.REGISTRY`, `from laya_aot.kinds import Kind`). That keeps the kinds' settings modules, which the
build schema (`config.py`) composes, importable before torch: `laya-aot build` checks overrides first.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, List

if TYPE_CHECKING:
    from .base import BuildContext, Built, Exported, Incoming, Kind, LoadEnv, Misfit, Runner, Skip, model_tensors
    from .registry import BY_NAME, NAMES, PORTABLE, REGISTRY, RUNTIME_ORDER, get, load, runtime_kinds

_FROM_BASE = ("BuildContext", "Built", "Exported", "Incoming", "Kind", "LoadEnv", "Misfit", "Runner", "Skip",
              "model_tensors")
_FROM_REGISTRY = ("BY_NAME", "NAMES", "PORTABLE", "REGISTRY", "RUNTIME_ORDER", "get", "load", "runtime_kinds")


def __getattr__(name: str) -> Any:
    if name in _FROM_BASE:
        from . import base as owner
    elif name in _FROM_REGISTRY:
        from . import registry as owner
    else:  # a submodule (`from laya_aot.kinds import aoti`) is imported by the import system after this
        raise AttributeError("module %r has no attribute %r" % (__name__, name))
    value = getattr(owner, name)
    globals()[name] = value  # looked up once; later reads are plain attributes
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = ["BY_NAME", "BuildContext", "Built", "Exported", "Incoming", "Kind", "LoadEnv", "Misfit", "NAMES", "PORTABLE",
           "REGISTRY", "RUNTIME_ORDER", "Runner", "Skip", "get", "load", "model_tensors", "runtime_kinds"]

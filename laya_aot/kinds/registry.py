"""The kind registry: every artifact kind in one table, in build order, and the lookups the pipeline, the
loader, the probe and the manifest reader use. `laya_aot.kinds` re-exports these names on first use.

Adding a kind: its module, imported here, and its `KIND` in `REGISTRY` (docs/architecture.md walks through
it). Nothing else names a kind.
"""
from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Dict, List, Mapping, Tuple

from ..manifest import Artifact
from . import aoti, exported_program, inductor_cache, onnx, tilelang
from .base import Kind, LoadEnv, Runner

# in build order: the exported program first, everything else is compiled from it
REGISTRY: Tuple[Kind, ...] = (exported_program.KIND, aoti.KIND, onnx.KIND, tilelang.KIND, inductor_cache.KIND)
_BY_NAME: Dict[str, Kind] = {k.name: k for k in REGISTRY}
# the kinds by name, read-only: what the manifest reader takes to run each kind's `check_details`
BY_NAME: Mapping[str, Kind] = MappingProxyType(_BY_NAME)
NAMES: Tuple[str, ...] = tuple(_BY_NAME)
# the kinds an agent can be served by, in their fixed order (used when no latency was measured)
RUNTIME_ORDER: Tuple[str, ...] = tuple(k.name for k in sorted(REGISTRY, key=lambda k: k.order) if k.serves)
# the kind every other one is compiled from (built first; a failure stops the build)
PORTABLE = exported_program.KIND


def get(name: str) -> Kind:
    """The kind called `name`; a KeyError names the known ones."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError("unknown artifact kind %r; this laya-aot knows %s" % (name, ", ".join(NAMES))) from None


def load(path: Path, art: Artifact, env: LoadEnv) -> Runner:
    """The runner of an artifact, from its kind's load step."""
    return get(art.kind).load(path, art, env)


def runtime_kinds() -> List[Kind]:
    return [_BY_NAME[n] for n in RUNTIME_ORDER]


__all__ = ["BY_NAME", "NAMES", "PORTABLE", "REGISTRY", "RUNTIME_ORDER", "get", "load", "runtime_kinds"]

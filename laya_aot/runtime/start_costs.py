"""What each artifact cost to start on this machine: recorded by the loader after every start it served, read
when the loader (and `inspect`) rank a bundle's artifacts.

The build measures what each artifact costs per call, on a mix of shapes (`Artifact.latency_ms`); what it costs
to start depends on this machine (its disks, its CPU, whether the route builds laya's module or loads
kernels). A start's cost is the whole of `laya_aot.load` for it: laya's agent, the artifact's load, checks and
smoke check, as the service waits for them. Only starts whose probe verdict was already cached are recorded, so
the figures compare like with like (a first start's probe child is paid once per machine). `select.rank` uses
them between artifacts whose measured mix is within `select.MIX_TIE` of the fastest: there, one that starts
faster here by more than `select.START_TIE` goes first. An entry is read through `files.read_cache_json` (a
figure that is not a start's, or not this artifact's, is none): at worst a wrong figure reorders artifacts whose
measured mix is within the tie.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, Iterable, Optional

from ..files import finite_number, read_cache_json, write_cache_json
from ..manifest import Artifact
from ..variant import Machine


def _path(art: Artifact, machine: Machine, device: str) -> Path:
    from ..probe import verdict_path

    return verdict_path(art, machine, "start:" + device)  # keyed like a verdict: the entry and the machine


def record(art: Artifact, machine: Machine, device: str, seconds: float) -> None:
    """Remember that starting `art` on this machine and device took `seconds` (best effort: a cache that cannot be
    written only loses the figure)."""
    write_cache_json(_path(art, machine, device), {"artifact": art.name, "start_s": round(float(seconds), 3),
                                                   "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                     "no start of %s is compared with another's" % art.name)


def record_start(art: Artifact, machine: Machine, device: str, seconds: float, probe: Optional[str]) -> None:
    """`record` a start of `art` that took `seconds`, unless it ran the probe child (`probe`: the start's record of
    its probe, None where its kind has none), paid once per machine: the figures compare later starts with later
    starts."""
    if probe in (None, "cached"):
        record(art, machine, device, seconds)


def known(arts: Iterable[Artifact], machine: Machine, device: str) -> Dict[str, float]:
    """The recorded start cost of each of `arts` on this machine and device, by name (those never started here
    are left out)."""
    out: Dict[str, float] = {}
    for art in arts:
        seconds = _read(_path(art, machine, device), art)
        if seconds is not None:
            out[art.name] = seconds
    return out


def _read(path: Path, art: Artifact) -> Optional[float]:
    """The seconds `record` wrote at `path` for `art` (None: none, or not a start's figure)."""
    entry = read_cache_json(path, {"artifact": str, "start_s": _seconds})
    return float(entry["start_s"]) if entry is not None and entry["artifact"] == art.name else None


def _seconds(value: object) -> bool:
    return finite_number(value) and 0 <= value < 1e6  # type: ignore[operator]

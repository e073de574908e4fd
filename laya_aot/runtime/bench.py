"""The artifacts' latencies measured on the machine that serves them (`laya-aot bench BUNDLE`), which the loader
ranks by in place of the build's.

A build times each artifact on the build machine, whose load and threads are not the service's.
`runtime/measure.measure` loads every artifact of a bundle that can serve here, through the loader's own checks
(hash, probe child, load, smoke check: runtime/trial.py), and `timed` times them on the mix of shapes their build
timed (the keys of `Artifact.latency_ms`) in interleaved rounds after warm-up calls: every artifact sees the same
moments of a busy machine, so a burst of other work slows all of them alike instead of one. The medians, their
spread and the threads they ran on are stored in this machine's cache (`store`), keyed by the bundle's sha256 (its
bundle.json's), the machine's facts, the device type, the serving dtype, the compute threads and OpenMP's wait
policy (`path`; one measured with another wait policy is read where this process's has none); `known`
reads an entry back through `files.read_cache_json`, each figure checked, each artifact by name and sha256, and
`select.select` ranks by it where one exists (the load's
log line and `load_stats["ranking"]` say which ranked). A figure that is not one, or not this artifact's, is a
miss: the build's figures rank.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Tuple

from ..files import cache_dir, read_cache_json, sha256_hex, write_json_atomic
from ..manifest import Artifact

if TYPE_CHECKING:
    from ..kinds.usable import Here

log = logging.getLogger(__name__)

BENCH_VERSION = 1  # bumped when what is measured changes: older rankings are then not read
WARMUP = 3   # calls per artifact and shape before any is timed (kernels, caches, the first call's lazy loading)
ROUNDS = 20  # timed rounds; each round calls every artifact once on every shape, one after another
_SHAPE = re.compile(r"[0-9]{1,6}x[0-9]{1,7}x[0-9]{1,5}")


@dataclass
class Measured:
    """A ranking measured here: per artifact, the median ms and the spread (90th minus 10th percentile) per shape,
    when and how it was measured, and why any usable artifact could not be timed."""

    figures: Dict[str, Dict[str, float]]
    spread: Dict[str, Dict[str, float]] = field(default_factory=dict)
    when: str = ""
    rounds: int = 0
    threads: int = 0
    not_timed: Dict[str, str] = field(default_factory=dict)
    other_wait_policy: Optional[str] = None  # measured with OMP_WAIT_POLICY set otherwise than this process has it

    def describe(self) -> str:
        """How the load's log line and load_stats["ranking"] name it."""
        other = self.other_wait_policy
        return "measured here by `laya-aot bench` at %s (%d rounds, %d threads%s)" % (
            self.when, self.rounds, self.threads, "" if other is None else
            "; OpenMP's wait policy %s there, %s in this process" % (other, _policy_words(wait_policy())))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def threads() -> int:
    """The compute threads the artifacts run on in this process (torch's intra-op pool, which ONNX follows)."""
    import torch

    return torch.get_num_threads()


def wait_policy() -> Optional[str]:
    """This process's OMP_WAIT_POLICY (kinds/cpu_threads.py sets PASSIVE unless torch was imported first)."""
    return os.environ.get("OMP_WAIT_POLICY")


def _policy_words(policy: Optional[str]) -> str:
    return "unset" if policy is None else policy


_UNSET = object()


def _facts(bundle_sha256: str, here: "Here") -> Dict[str, Any]:
    """What a ranking is keyed by but the wait policy: bundle, machine (its facts, CPU model and count), device,
    serving dtype and thread count (read once per lookup: the CPU model is a read of /proc/cpuinfo)."""
    return {"bundle": bundle_sha256, "machine": dict(here.machine.as_dict(), traced_packages=None),
            "device": here.device_type, "serving": here.serving, "threads": threads(), "cpu": _cpu_model(),
            "cpus": os.cpu_count(), "version": BENCH_VERSION}


def _path_of(facts: Dict[str, Any], policy: Optional[str]) -> Path:
    key = hashlib.sha256(json.dumps(dict(facts, wait_policy=policy), sort_keys=True).encode()).hexdigest()
    return cache_dir() / "rankings" / (key + ".json")


def path(bundle_sha256: str, here: "Here", policy: Any = _UNSET) -> Path:
    """Where the ranking of that bundle on this machine is cached, keyed by `_facts` and OpenMP's wait policy (this
    process's unless `policy` is given)."""
    return _path_of(_facts(bundle_sha256, here), wait_policy() if policy is _UNSET else policy)


def _ms(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and 0 <= value < 1e7


def _shapes(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(
        isinstance(k, str) and _SHAPE.fullmatch(k) and _ms(v) for k, v in value.items())


def _entry(value: Any) -> bool:
    return (isinstance(value, dict) and sha256_hex(value.get("sha256")) and _shapes(value.get("latency_ms"))
            and (value.get("spread_ms") is None or _shapes(value.get("spread_ms"))))


def known(bundle_sha256: str, arts: Iterable[Artifact], here: "Here") -> Optional[Measured]:
    """The ranking `store` wrote for this bundle on this machine, of those of `arts` it timed (None: none, or an
    entry that is not one, or one that times none of them). One measured with OpenMP's wait policy set otherwise
    (`laya-aot bench` runs with PASSIVE; a service that imported torch before laya-aot runs with it unset) is
    taken where none of this process's exists: it was measured on this machine, the build's figures were not."""
    arts = list(arts)
    own, facts = wait_policy(), _facts(bundle_sha256, here)
    for policy in [own] + [p for p in ("PASSIVE", None) if p != own]:
        measured = _read(bundle_sha256, arts, _path_of(facts, policy))
        if measured is not None:
            measured.other_wait_policy = None if policy == own else _policy_words(policy)
            return measured
    return None


def _read(bundle_sha256: str, arts: List[Artifact], where: Path) -> Optional[Measured]:
    entry = read_cache_json(where, {
        "bundle_sha256": lambda v: v == bundle_sha256, "when": str,
        "rounds": lambda v: type(v) is int and v > 0, "threads": lambda v: type(v) is int and v > 0,
        "artifacts": lambda v: isinstance(v, dict) and all(isinstance(k, str) and _entry(e) for k, e in v.items()),
        "not_timed": lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values())})
    if entry is None:
        return None
    by_name = {a.name: a for a in arts}
    timed = {n: e for n, e in entry["artifacts"].items() if n in by_name and by_name[n].sha256 == e["sha256"]}
    if not timed:
        return None
    return Measured({n: dict(e["latency_ms"]) for n, e in timed.items()},
                    {n: dict(e.get("spread_ms") or {}) for n, e in timed.items()},
                    entry["when"], entry["rounds"], entry["threads"], dict(entry["not_timed"]))


def store(bundle_sha256: str, arts: Iterable[Artifact], here: "Here", measured: Measured) -> Path:
    """Write `measured` as this machine's ranking of the bundle (an OSError says why it could not be)."""
    by_name = {a.name: a for a in arts}
    out = path(bundle_sha256, here)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, {
        "bundle_sha256": bundle_sha256, "when": measured.when, "rounds": measured.rounds,
        "threads": measured.threads, "device": here.device,
        "artifacts": {n: {"sha256": by_name[n].sha256, "latency_ms": ms, "spread_ms": measured.spread.get(n)}
                      for n, ms in measured.figures.items()},
        "not_timed": measured.not_timed})
    return out


def timed(runners: Dict[str, Tuple[Any, Artifact]], shapes: Dict[str, List[str]], pad_id: int, rounds: int,
          warmup: int) -> Tuple[Dict[str, Dict[str, float]], Dict[str, Dict[str, float]]]:
    """Per artifact and shape, the median ms and the spread over `rounds` interleaved rounds (module docstring)."""
    import torch

    from ..padding import batch_of_shape
    from ..verification import interleaved_ms, run_padded

    calls = []
    for name, (runner, art) in runners.items():
        for shape in shapes[name]:
            batch = batch_of_shape(*(int(x) for x in shape.split("x")))
            sync = torch.cuda.synchronize if runner.device.type == "cuda" else None
            calls.append((name, shape, lambda r=runner, a=art, b=batch: run_padded(r, b, a.ranges, pad_id,
                                                                                     r.device), sync))
    return interleaved_ms(calls, rounds, warmup)

"""Whether an artifact can serve an agent on this machine, from the manifest alone.

Used by the loader's selection (`runtime/select.py`), `laya-aot inspect` and fetching (`distribution/fetch.py`,
which downloads only the artifacts this machine can use), so it sits below them; `default_device` is the
one place that picks cuda or cpu when no device is given. It reads the manifest, the kinds' facts (what each
alone needs of a machine: `Kind.misfit`), the machine's variant and laya's precision policy, never an artifact's bytes.
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, List, Mapping, Optional, Set, Tuple

from .. import kinds
from ..manifest import Artifact, Bundle
from ..numerics import precision
from ..variant import Machine, current_machine, mismatch, with_software_of


def default_device() -> str:
    """The device an agent runs on when none is given: cuda when a GPU is visible, else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Here:
    """What decides usability on this machine for an agent on `device`: its device type, the machine's facts
    and the dtype laya serves the checkpoint in here."""

    device: str
    device_type: str
    machine: Machine
    serving: str

    def reject_reason(self, art: Artifact) -> Optional[str]:
        return reject_reason(art, self.machine, self.device_type, self.serving)


def here(rl_config: Mapping[str, Any], device: Optional[str] = None) -> Here:
    """This machine for an agent on `device` (default: `default_device()`) of a checkpoint whose config (its
    rl_agent_config.json, or the manifest's record of its amp_dtype) is `rl_config`."""
    import torch

    dev = str(device or default_device())
    dev_type = torch.device(dev).type
    machine = current_machine(dev)
    return Here(dev, dev_type, machine, precision.expected_serving_dtype(dict(rl_config), dev_type, machine.gpu_arch))


def here_for(manifest: Bundle, device: Optional[str] = None) -> Here:
    """`here` for the checkpoint a manifest was built from (its recorded amp_dtype)."""
    return here({"amp_dtype": manifest.checkpoint.amp_dtype}, device)


def usable_here(manifest: Bundle, device: Optional[str] = None) -> Tuple[List[Artifact], List[Tuple[str, str]]]:
    """The artifacts an agent on `device` (default: `default_device()`) could use here, and a reason for each
    other one; the same rule as the loader's first check."""
    h = here_for(manifest, device)
    ok: List[Artifact] = []
    skipped: List[Tuple[str, str]] = []
    for a in manifest.artifacts:
        why = h.reject_reason(a)
        if why is None:
            ok.append(a)
        else:
            skipped.append((a.name, why))
    return ok, skipped


def refused_for_software(arts: Iterable[Artifact], h: Here) -> List[Tuple[str, str]]:
    """(name, reason) of each artifact of `arts` refused here only for this process's software (torch, its CUDA
    runtime, what its kind alone needs and says an install fixes, `Misfit.software`): with what it was built with
    installed, it could serve. A load stops at the first artifact that serves and never examines these; `laya-aot
    serve` and `laya-aot demo` name them, with the fix, beside the load's own reasons."""
    out: List[Tuple[str, str]] = []
    for art in arts:
        why = h.reject_reason(art)
        if why is None:
            continue
        own = kinds.get(art.kind).misfit(art, h.machine)
        if (own is None or own.software) and _reject(art, with_software_of(h.machine, art.needs), h.device_type,
                                                     h.serving, own_needs=False) is None:
            out.append((art.name, why))
    return out


_named_once: set = set()
_named_lock = threading.Lock()


def warn_refused_for_software(arts: Iterable[Artifact], h: Here, bundle_sha256: str, bundle_name: Any, served: str,
                              examined: Set[str], stacklevel: int) -> None:
    """A load's artifacts it never examined (it stops at the first that serves: `served`, the others `examined`)
    that would serve here with the build's software (`refused_for_software`): one warning per process for each
    (`bundle_sha256`'s), with the fix, as `laya-aot serve` names them in its log and `/v1/aot`."""
    refused = [(n, why) for n, why in refused_for_software([a for a in arts if a.name not in examined | {served}], h)
               if (bundle_sha256, n) not in _named_once]
    if not refused:
        return
    with _named_lock:
        _named_once.update((bundle_sha256, n) for n, _ in refused)
    warnings.warn("laya-aot: %s serves %s; refused for this process's software, though they could serve here: %s"
                  % (bundle_name, served, "; ".join("%s: %s" % kv for kv in refused)), RuntimeWarning,
                  stacklevel=stacklevel + 1)


def machine_misfit(art: Artifact, machine: Machine) -> Optional[str]:
    """Why `machine` cannot run `art` (None: it can): what its kind alone needs first, whose reason names its own
    fix and is the only one (`Kind.misfit`), else the facts every kind shares (`variant.mismatch`)."""
    own = kinds.get(art.kind).misfit(art, machine)
    return own.why if own else mismatch(art.needs, machine)


def reject_reason(art: Artifact, machine: Machine, agent_device: str, serving_dtype: str) -> Optional[str]:
    """Why `art` cannot serve an agent on `agent_device` that laya runs in `serving_dtype`, from the manifest
    alone (None: it may)."""
    return _reject(art, machine, agent_device, serving_dtype, own_needs=True)


def _reject(art: Artifact, machine: Machine, agent_device: str, serving_dtype: str, own_needs: bool) -> Optional[str]:
    """`reject_reason`; without `own_needs`, what the artifact's kind alone needs of a machine is taken as met."""
    if art.invalid:  # the reader found values no build writes in this entry: this artifact only is out
        return "its manifest entry is invalid (%s); rebuild the bundle with `laya-aot build`" % art.invalid
    kind = kinds.get(art.kind)
    if not kind.serves:
        return "the portable %s is what the other artifacts are compiled from, not a runtime artifact" % kind.name
    if art.status == "build_failed":
        return "its build failed: %s" % art.error
    if art.status == "failed_verification":
        return "it failed verification at build time: %s" % (art.verify.reason if art.verify else None)
    if art.status == "unverified" and not kind.verified_at_build:
        pass  # cross-compiled without a GPU: the loader verifies it on this machine before using it
    elif art.status != "verified":
        why = (art.verify.reason if art.verify else None) or "status %r" % art.status
        return "it is not verified (%s)" % why
    refused = kind.refuse_device(agent_device)
    if refused:
        return refused
    if art.needs.device != agent_device:
        return "built for %s, the agent runs on %s" % (art.needs.device, agent_device)
    misfit = machine_misfit(art, machine) if own_needs else mismatch(art.needs, machine)
    return misfit or precision.why_not(str(art.dtype), serving_dtype, agent_device,
                                       art.precision.gemm if art.precision else None)

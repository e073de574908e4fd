"""Whether an artifact can serve an agent on this machine, from the manifest alone.

Used by the loader's selection (`runtime/select.py`) and by fetching (`distribution/fetch.py`, which
downloads only the artifacts this machine can use), so it sits below both: it reads the manifest,
the kinds' facts, the machine's variant and laya's precision policy, never an artifact's bytes.
"""
from __future__ import annotations

from typing import Optional

from . import kinds, precision
from .manifest import Artifact
from .variant import Machine, mismatch


def reject_reason(art: Artifact, machine: Machine, agent_device: str, serving_dtype: str) -> Optional[str]:
    """Why `art` cannot serve an agent on `agent_device` that laya runs in `serving_dtype`, from the manifest
    alone (None: it may)."""
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
    return mismatch(art.needs, machine) or precision.why_not(str(art.dtype), serving_dtype, agent_device)

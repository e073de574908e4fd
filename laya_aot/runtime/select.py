"""Which of a bundle's artifacts this machine can run, in which order to try them, and why not the rest.

Every rejected artifact gets exactly one reason, phrased so an operator knows what to do about it.
Checks here read only the manifest and the machine's facts; hashing and probing (which touch the
artifact's bytes) come after, in `loader`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..variant import Machine, mismatch

# The fixed order when the bundle has no latency measured on this kind of device.
KIND_ORDER = ("tilelang", "aoti", "compile", "onnx")
RUNTIME_KINDS = set(KIND_ORDER)


def reject_reason(entry: Dict[str, Any], machine: Machine, agent_device: str) -> Optional[str]:
    """Why `entry` cannot serve an agent on `agent_device` here, from the manifest alone (None: it may)."""
    kind = entry.get("kind")
    if kind not in RUNTIME_KINDS:
        return "the portable %s is what the other artifacts are compiled from, not a runtime artifact" % kind
    status = entry.get("status")
    if status == "build_failed":
        return "its build failed: %s" % entry.get("error")
    if status == "failed_verification":
        return "it failed verification at build time: %s" % (entry.get("verify") or {}).get("reason")
    if status == "unverified" and kind == "tilelang":
        pass  # cross-compiled without a GPU: the loader verifies it on this machine before using it
    elif status != "verified":
        why = (entry.get("verify") or {}).get("reason") or "status %r" % status
        return "it is not verified (%s)" % why
    needs = entry.get("needs") or {}
    dev = needs.get("device")
    if kind == "onnx" and agent_device != "cpu":
        return "ONNX Runtime runs on the CPU and this agent runs on %s, where the GPU forward is faster" % agent_device
    if dev and dev != agent_device:
        return "built for %s, the agent runs on %s" % (dev, agent_device)
    return mismatch(needs, machine)


def _latency(entry: Dict[str, Any], device: str) -> Optional[float]:
    per_device = (entry.get("latency_ms") or {}).get(device) or {}
    return sum(per_device.values()) if per_device else None


def rank(entries: List[Dict[str, Any]], device: str, prefer: Optional[str] = None
         ) -> Tuple[List[Dict[str, Any]], List[Tuple[str, str]]]:
    """Candidates in the order to try them, and (name, reason) for those `prefer` rules out.

    Measured latency on this kind of device ranks first (fastest first); artifacts without a figure
    follow in the fixed order tilelang, aoti, compile, onnx.
    """
    skipped: List[Tuple[str, str]] = []
    pool = list(entries)
    if prefer:
        if prefer not in RUNTIME_KINDS:
            raise ValueError("prefer=%r is not an artifact kind; use one of %s" % (prefer, ", ".join(KIND_ORDER)))
        skipped = [(e["name"], "not the preferred kind (prefer=%r)" % prefer)
                   for e in pool if e.get("kind") != prefer and e.get("kind") in RUNTIME_KINDS]
        pool = [e for e in pool if e.get("kind") == prefer]

    def key(e: Dict[str, Any]):
        lat = _latency(e, device)
        order = KIND_ORDER.index(e["kind"]) if e.get("kind") in KIND_ORDER else len(KIND_ORDER)
        return (0, lat, order) if lat is not None else (1, order, 0.0)

    return sorted(pool, key=key), skipped

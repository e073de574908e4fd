"""The base of every error laya-aot raises on purpose: `except laya_aot.LayaAotError` catches them all; and what
counts as the device running out of memory, one rule for the backend (which runs rows again in halves) and the CUDA
graph policy (which tries a capture again later).

Each public error also keeps the builtin base it had before (RuntimeError, ValueError, FileNotFoundError),
so a caller's existing `except` clause still catches it. The hierarchy is in docs/architecture.md. This module
imports no torch at its top (the build schema reaches it before torch loads): the memory rule imports it when asked.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:
    import torch


class LayaAotError(Exception):
    """Something laya-aot refuses or cannot do; the message names the cause and, where there is one, the fix."""


def one_line(error: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message` (at most `limit` characters of it), or `Type` alone: how a log line or a
    recorded reason names a failure whose traceback would bury the line it sits in."""
    first = (str(error).strip().splitlines() or [""])[0][:limit]
    return "%s: %s" % (type(error).__name__, first) if first else type(error).__name__


_OOMS_SEEN: Dict[Optional[int], int] = {}  # the CUDA allocator's out-of-memory count per device, when last read


def out_of_memory(error: BaseException, device: "torch.device") -> bool:
    """Whether `error` is the device running out of memory: torch's OutOfMemoryError, a message that says so
    (laya's own rule), or an AOTInductor package's bare RuntimeError raised while the CUDA allocator counted a
    new out-of-memory (the package prints the cause to stderr and raises "run_func_(...) API call failed")."""
    import torch

    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower():
        return True
    if device.type != "cuda":
        return False
    seen = _OOMS_SEEN.get(device.index, 0)
    ooms = _OOMS_SEEN[device.index] = _count(device)
    return ooms > seen


def count_from_now(device: "torch.device") -> None:
    """Count the allocator's out-of-memory errors on `device` from here on (those before are not this code's)."""
    if device.type == "cuda":
        _OOMS_SEEN.setdefault(device.index, _count(device))


def _count(device: "torch.device") -> int:
    import torch

    return int(torch.cuda.memory_stats(device).get("num_ooms", 0))


__all__ = ["LayaAotError", "count_from_now", "out_of_memory"]

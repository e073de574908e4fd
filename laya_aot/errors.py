"""The base of every error laya-aot raises on purpose: `except laya_aot.LayaAotError` catches them all.

Each public error also keeps the builtin base it had before (RuntimeError, ValueError, FileNotFoundError),
so a caller's existing `except` clause still catches it. The hierarchy is in docs/architecture.md.
"""
from __future__ import annotations


class LayaAotError(Exception):
    """Something laya-aot refuses or cannot do; the message names the cause and, where there is one, the fix."""


__all__ = ["LayaAotError"]

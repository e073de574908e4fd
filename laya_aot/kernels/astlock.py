"""Serialise `ast.parse` while kernels lower in threads.

CPython 3.11 keeps one AST-construction recursion counter per interpreter, shared by every
thread. When the garbage collector runs a finaliser in the middle of one thread's `ast.parse`,
another thread can parse too, and the first one fails with `SystemError: AST constructor
recursion depth mismatch`. TileLang's lowering parses macro sources (`_gemm_ssr` and others),
so a thread pool of TileLang compiles can hit this at random (a CI run lost a kernel to it once).
Holding one lock around `ast.parse` for the duration of the pool removes the race; parsing is a
small part of a kernel's compile time, and nvcc still runs in parallel.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import threading
from typing import Iterator

_parse_lock = threading.RLock()
_users_lock = threading.Lock()
_users = 0
_unlocked_parse = ast.parse


@functools.wraps(_unlocked_parse)
def _locked_parse(*args, **kwargs):
    with _parse_lock:
        return _unlocked_parse(*args, **kwargs)


@contextlib.contextmanager
def serial_ast_parse() -> Iterator[None]:
    """Within this block (from any thread, nested or concurrent), `ast.parse` runs one call at a time."""
    global _users
    with _users_lock:
        if _users == 0:
            ast.parse = _locked_parse
        _users += 1
    try:
        yield
    finally:
        with _users_lock:
            _users -= 1
            if _users == 0:
                ast.parse = _unlocked_parse


__all__ = ["serial_ast_parse"]

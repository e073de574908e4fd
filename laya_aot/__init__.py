"""laya-aot: prebuilt, per-GPU inference bundles for Laya decision models.

    laya-aot build checkpoint.path=DIR          # build a verified bundle (Hydra overrides)
    agent = laya_aot.load(DIR, bundle="artifacts/NAME")   # a laya.Agent running the best artifact
    batcher = laya_aot.Batcher(agent)                      # thread-safe: batcher.submit(state, questions) -> Future

Importing this package is cheap: torch, laya and Hydra load only when a function needs them.
"""
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import LayaAotError

if TYPE_CHECKING:  # type checkers and IDEs see the loader's own signature
    from .runtime.batcher import Batcher, Limits
    from .runtime.loader import load
    from .runtime.session import LoadConfig


def __getattr__(name: str) -> Any:
    """`laya_aot.load` is `laya_aot.runtime.loader.load` itself, not a wrapper: `help()` and IDEs show its
    signature, and its warnings point at the caller's line. Looking it up imports the loader, which imports no torch
    and starts nothing: torch and laya load when it is called, after the checks of its paths and bundle."""
    if name == "load":
        from .runtime.loader import load

        globals()["load"] = load
        return load
    if name == "LoadConfig":  # load()'s keywords as one object (runtime/session.py)
        from .runtime.session import LoadConfig

        globals()["LoadConfig"] = LoadConfig
        return LoadConfig
    if name in ("Batcher", "Limits"):  # the dynamic batcher and its limits (runtime/batcher.py): no torch
        from .runtime import batcher

        globals()[name] = getattr(batcher, name)
        return globals()[name]
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def __dir__() -> list:
    return sorted(set(globals()) | {"load", "Batcher", "Limits", "LoadConfig"})


__all__ = ["Batcher", "LayaAotError", "Limits", "LoadConfig", "load", "__version__"]

"""laya-aot: prebuilt, per-GPU inference bundles for Laya decision models.

    laya-aot build checkpoint.path=DIR          # build a verified bundle (Hydra overrides)
    agent = laya_aot.load(DIR, bundle="artifacts/NAME")   # a laya.Agent running the best artifact

Importing this package is cheap: torch, laya and Hydra load only when a function needs them.
"""
from ._version import __version__


def load(*args, **kwargs):
    """See `laya_aot.runtime.loader.load`."""
    from .runtime.loader import load as _load

    return _load(*args, **kwargs)


__all__ = ["load", "__version__"]

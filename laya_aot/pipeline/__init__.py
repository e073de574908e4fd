"""The build half: checkpoint -> verified bundle (see `stages`).

`build` and `BuildError` load the stages (and Hydra's OmegaConf) on first use, so importing the
package for a config or a report costs nothing.
"""
from typing import Any

__all__ = ["BuildError", "BuildResult", "build"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import stages

        return getattr(stages, name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))

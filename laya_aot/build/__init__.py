"""The build half: checkpoint -> verified bundle (see `pipeline`).

`build` and `BuildError` load the pipeline (and Hydra's OmegaConf) on first use, so the runtime,
which reuses `build.verify`, does not pay for them at start-up.
"""
from typing import Any

__all__ = ["BuildError", "build"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))

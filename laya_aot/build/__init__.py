"""The build half: checkpoint -> verified bundle (see `pipeline`)."""
from .pipeline import BuildError, build

__all__ = ["BuildError", "build"]

"""The package version, apart from `__init__` so that modules can read it without importing the runtime."""
__version__ = "0.1.0"

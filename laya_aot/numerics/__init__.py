"""Numbers and their precision: the dtype vocabulary (dtypes), the dtype laya serves a checkpoint in and how an
artifact computes (precision), and the verification rule an artifact is held to (tolerance). Imports no torch at
the package level: the build schema (config.py) composes its dataclasses before torch is imported."""

"""Fixtures of the shared modules' tests: a demo bundle's manifest as data, no build needed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# bundle.json of the demo bundle (tests/conftest.py::demo_bundle: the tiny demo checkpoint, seed 0, the
# default CPU build with export.ship_program=true: exported program, two AOTInductor packages, ONNX), kept so
# that the manifest reader's tests run without one; test_manifest.py checks (slow) that a fresh build
# writes no field it lacks
SAMPLE_MANIFEST = HERE / "demo_manifest.json"


@pytest.fixture(scope="session")
def manifest() -> dict:
    return json.loads(SAMPLE_MANIFEST.read_text(encoding="utf-8"))

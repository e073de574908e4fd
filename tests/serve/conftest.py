"""Fixtures of the serve tests."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

SAMPLE_MANIFEST = Path(__file__).resolve().parents[1] / "shared" / "demo_manifest.json"


@pytest.fixture
def bundle_dir(tmp_path) -> Path:
    """A directory holding the demo bundle's bundle.json and no artifact: all that reading the serve settings
    looks at (a directory, its manifest file), without a build."""
    out = tmp_path / "bundle"
    out.mkdir()
    shutil.copyfile(SAMPLE_MANIFEST, out / "bundle.json")
    return out

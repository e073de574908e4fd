"""The basics a user looks for (issue 22, item 8): a licence, a changelog, a version, type information, and
`laya_aot.load` as the loader itself."""
from __future__ import annotations

import inspect
import subprocess
import sys
import warnings
from pathlib import Path

import laya_aot

ROOT = Path(__file__).resolve().parents[2]


def test_licence_changelog_and_type_marker_ship():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert "## %s" % laya_aot.__version__ in (ROOT / "CHANGELOG.md").read_text()
    assert (ROOT / "laya_aot" / "py.typed").is_file()
    assert '"py.typed"' in (ROOT / "pyproject.toml").read_text()


def test_load_is_the_loader_with_its_signature_and_import_stays_cheap():
    from laya_aot.runtime.loader import load

    assert laya_aot.load is load
    params = inspect.signature(laya_aot.load).parameters
    assert {"checkpoint", "bundle", "device", "prefer", "strict", "bundle_sha256", "near_ties"} <= set(params)
    p = subprocess.run([sys.executable, "-c", "import sys, laya_aot; print('torch' in sys.modules, "
                        "'load' in dir(laya_aot))"], capture_output=True, text=True, cwd=ROOT)
    assert p.stdout.split() == ["False", "True"], p.stderr


def test_the_fallback_warning_points_at_the_callers_line(demo_ckpt):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        agent = laya_aot.load(str(demo_ckpt), bundle=None, device="cpu")
    assert agent.backend == "eager"
    fallback = [w for w in caught if issubclass(w.category, RuntimeWarning) and "eager forward" in str(w.message)]
    assert fallback and fallback[0].filename == __file__, [(w.filename, str(w.message)[:80]) for w in caught]

"""Shared fixtures: demo checkpoints and bundles made once per test session (AOTInductor takes ~20 s)."""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Probe verdicts and digests go to a per-session directory, never the user's ~/.cache."""
    os.environ["LAYA_AOT_CACHE_DIR"] = str(tmp_path_factory.mktemp("laya-aot-cache"))
    yield


@pytest.fixture(scope="session")
def demo_ckpt(tmp_path_factory) -> Path:
    from laya_aot.demo import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "demo", "tiny", seed=0)


@pytest.fixture(scope="session")
def alt_ckpt(tmp_path_factory) -> Path:
    from laya_aot.demo import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "alt", "tiny-alt", seed=3)


def build_bundle(ckpt: Path, out: Path, *overrides: str) -> dict:
    from laya_aot.config import compose
    from laya_aot.pipeline import build

    cfg = compose(["checkpoint.path=%s" % ckpt, "output_dir=%s" % out, *overrides])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(cfg).bundle.to_dict()


@pytest.fixture(scope="session")
def demo_bundle(demo_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "demo"
    build_bundle(demo_ckpt, out)
    return out


@pytest.fixture(scope="session")
def alt_bundle(alt_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "alt"
    build_bundle(alt_ckpt, out)
    return out


# the exported program and ONNX only, 8 rows: a real bundle built in seconds (the safety and archive tests)
SMALL = ["stages.aoti=false", "stages.inductor_cache=false", "export.max_rows=8"]


@pytest.fixture(scope="session")
def small_bundle(demo_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "small"
    build_bundle(demo_ckpt, out, *SMALL)
    return out


@pytest.fixture
def bundle_copy(demo_bundle, tmp_path) -> Path:
    """A private copy of the demo bundle that a test may damage."""
    dst = tmp_path / "bundle"
    shutil.copytree(demo_bundle, dst)
    return dst

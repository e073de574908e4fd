"""One load is one `LoadSession` (runtime/loader.py): bundle.json read and parsed once, the start order made once
(`select.select`) for the loader, its head start and `laya-aot inspect`, and what is wrong with the paths or the
bundle answered before torch or laya is imported."""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

import laya_aot
from tests.conftest import another_torch, built_with_torch

FAST_FAILURE = """
import json, sys
import laya_aot
try:
    laya_aot.load(sys.argv[1], bundle=sys.argv[2], device="cpu", strict=True)
    said = None
except Exception as e:
    said = "%s: %s" % (type(e).__name__, e)
print("RESULT " + json.dumps({"said": said, "heavy": sorted(m for m in ("torch", "laya", "transformers")
                                                              if m in sys.modules)}))
"""


def _strict_load_in_child(ckpt, bundle, **env) -> dict:
    p = subprocess.run([sys.executable, "-c", FAST_FAILURE, str(ckpt), str(bundle)], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, **env))
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, p.stderr[-3000:]
    return json.loads(line[7:])


def test_a_wrong_checkpoint_path_or_a_missing_bundle_is_answered_before_torch(demo_ckpt, tmp_path):
    """`load` checks the paths first: one clear error, and neither torch nor laya imported (seconds saved)."""
    got = _strict_load_in_child(tmp_path / "no-such-checkpoint", tmp_path / "no-such-bundle")
    assert got["heavy"] == [] and got["said"].startswith("CheckpointNotFound: "), got
    assert "does not exist" in got["said"]
    got = _strict_load_in_child(demo_ckpt, tmp_path / "no-such-bundle")
    assert got["heavy"] == [] and got["said"].startswith("NoArtifactError: "), got
    assert "does not exist or is not a directory" in got["said"] and "laya-aot build" in got["said"]
    # the two swapped: a bundle (or any directory) where the checkpoint goes is named so, before laya loads
    bundle = tmp_path / "a-bundle"
    bundle.mkdir()
    (bundle / "bundle.json").write_text("{}")
    got = _strict_load_in_child(bundle, demo_ckpt)
    assert got["heavy"] == [] and got["said"].startswith("CheckpointNotFound: "), got
    assert "has no rl_agent_config.json; it is a laya-aot bundle: pass it as bundle=" in got["said"]
    got = _strict_load_in_child(tmp_path, demo_ckpt)
    assert got["heavy"] == [] and "is not a Laya checkpoint: it has no rl_agent_config.json" in got["said"], got


@pytest.mark.slow
def test_a_foreign_or_wrongly_pinned_bundle_is_answered_before_torch(demo_ckpt, demo_bundle, tmp_path):
    other = tmp_path / "other-ckpt"
    shutil.copytree(demo_ckpt, other)
    config = other / "rl_agent_config.json"
    config.write_text(config.read_text() + "\n")  # another checkpoint's config: its small files differ
    got = _strict_load_in_child(other, demo_bundle)
    assert got["heavy"] == [] and got["said"].startswith("NoArtifactError: "), got
    assert "built from another checkpoint" in got["said"] and "rl_agent_config.json" in got["said"]
    assert "laya-aot build checkpoint.path=%s" % other in got["said"]
    got = _strict_load_in_child(demo_ckpt, demo_bundle, LAYA_AOT_BUNDLE_SHA256="0" * 64)
    assert got["heavy"] == [] and got["said"].startswith("NoArtifactError: "), got
    assert "0" * 64 in got["said"] and "laya-aot inspect" in got["said"]


@pytest.mark.slow
def test_one_load_reads_bundle_json_once_and_makes_one_start_order(demo_ckpt, bundle_copy, tmp_path, monkeypatch):
    """The head start, the tokenizer's seeding, the trial of each candidate and a hand-over all take the one
    session's manifest and start order; `laya-aot inspect` takes its order from the same function."""
    from laya_aot import bundle_format
    from laya_aot.commands import inspect
    from laya_aot.manifest import Bundle
    from laya_aot.runtime import select

    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "cache"))  # a first start: the tokenizer is seeded
    reads, parses, orders = [], [], []
    real_bytes, real_parse, real_select = bundle_format._manifest_bytes, Bundle.from_dict.__func__, select.select
    monkeypatch.setattr(bundle_format, "_manifest_bytes", lambda b: reads.append(b) or real_bytes(b))
    monkeypatch.setattr(Bundle, "from_dict", classmethod(lambda cls, *a, **k: parses.append(1) or
                                                         real_parse(cls, *a, **k)))
    monkeypatch.setattr(select, "select", lambda *a, **k: orders.append(1) or real_select(*a, **k))
    agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", strict=True)
    assert agent.backend.startswith("aot:") and agent.backend_object.load_stats["ranking"] == "build"
    assert (len(reads), len(parses), len(orders)) == (1, 1, 1)
    assert inspect([str(bundle_copy)], time.perf_counter()) == 0
    assert len(orders) == 2


def test_the_start_order_is_written_in_one_place():
    """`rank`, `plan` and the start costs they take are used by `select.select` only: no other module of the
    package orders a start (`laya-aot inspect` and the head start included)."""
    root = Path(laya_aot.__file__).parent
    inner = {"rank", "plan", "start_tie_reason"}
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "runtime" / "select.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "select":
                found += ["%s imports %s" % (path.name, a.name) for a in node.names if a.name in inner]
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (
                    node.value.id == "select" and node.attr in inner
                    or node.value.id == "start_costs" and node.attr == "known"):
                found.append("%s uses %s.%s" % (path.name, node.value.id, node.attr))
    assert found == []


@pytest.mark.slow
def test_a_direct_load_names_the_artifacts_this_torch_refuses_once(demo_ckpt, bundle_copy, tmp_path, monkeypatch):
    """The AOTInductor packages say they were built under another torch: ONNX serves, and the load warns once per
    process with each name and the fix (the load never examined them: it stops at the first that serves)."""
    monkeypatch.setenv("LAYA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    version = another_torch()
    names = built_with_torch(bundle_copy, version)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu")
    assert agent.backend == "aot:onnx"
    said = [str(w.message) for w in seen if "refused for this process's software" in str(w.message)]
    assert len(said) == 1 and seen[[str(w.message) for w in seen].index(said[0])].filename == __file__, said
    for name in names:
        assert "%s: built for torch %s" % (name, version) in said[0] and "pip install torch==%s" % version in said[0]
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu")
    assert not [w for w in again if "refused for this process's software" in str(w.message)]


def test_load_config_is_loads_keywords_as_one_object(tmp_path):
    """`laya_aot.LoadConfig` holds `load`'s keywords; given with one of them set otherwise, `load` says which."""
    from laya_aot.runtime.session import LoadConfig, config_of

    assert laya_aot.LoadConfig is LoadConfig
    assert config_of(None, strict=True, prefer="onnx") == LoadConfig(strict=True, prefer="onnx")
    given = LoadConfig(strict=True)
    assert config_of(given, strict=False, prefer=None) is given       # load()'s defaults beside it: the config's
    with pytest.raises(TypeError, match="config= and prefer, strict"):
        laya_aot.load(str(tmp_path), bundle=str(tmp_path), strict=True, prefer="onnx", config=given)
    with pytest.raises(ValueError, match="near_ties='sometimes' is not a near-tie mode"):
        laya_aot.load(str(tmp_path), bundle=str(tmp_path), config=LoadConfig(near_ties="sometimes"))


@pytest.mark.parametrize("kwargs, says", [
    ({"prefer": "tensorrt"}, "prefer='tensorrt' is not an artifact kind"),
    ({"near_ties": "maybe"}, "near_ties='maybe' is not a near-tie mode"),
    ({"chunk_tokens": -5}, "chunk_tokens=-5 is not a token count"),
    ({"eager_module": "sometimes"}, "eager_module='sometimes' is not one of"),
    ({"bundle_sha256": "c7e24794"}, r"bundle_sha256='c7e24794' is not a sha256 \(64 hex digits\)"),
    ({"bundle_sha256": 12}, "bundle_sha256='12' is not a sha256"),
    ({"bundle": 3}, "bundle=3 is not a path"),
])
def test_a_load_argument_it_does_not_take_is_one_laya_aot_error_at_once(tmp_path, kwargs, says):
    """A caller's mistake in `load`'s arguments raises at once (no fallback to eager, no import of torch needed)
    as a LayaAotError that keeps its builtin base, as every error laya-aot raises on purpose does."""
    args = {"bundle": str(tmp_path), **kwargs}
    with pytest.raises(laya_aot.LayaAotError, match=says) as e:
        laya_aot.load(str(tmp_path), **args)
    assert isinstance(e.value, TypeError if "bundle" in kwargs else ValueError)

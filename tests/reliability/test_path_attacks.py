"""Every file a manifest names stays inside the bundle: links, absolute paths and `..` are refused by
load, inspect and verify alike, and no file outside the bundle is opened.

An audit hook records every file this process opens while the attack runs; a "secret" file outside the
bundle is the target of every attack, and opening it at all fails the test.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import warnings
from pathlib import Path

import pytest

import laya_aot
from laya_aot import commands
from laya_aot.files import write_json_atomic
from laya_aot.manifest import MANIFEST

OPENED: list = []
_HOOKED = False


def _hook(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        OPENED.append(os.fsdecode(args[0]))


@pytest.fixture
def secret(tmp_path):
    global _HOOKED
    if not _HOOKED:
        sys.addaudithook(_hook)   # hooks cannot be removed; this one only appends to a list
        _HOOKED = True
    p = tmp_path / "outside" / "secret.bin"
    p.parent.mkdir()
    p.write_bytes(b"not part of any bundle")
    OPENED.clear()
    return p


def _opened(secret: Path):
    real = os.path.realpath(secret)
    return [p for p in OPENED if os.path.realpath(p) == real or "secret" in p]


def _all_three(bundle: Path, ckpt: Path, secret: Path, expect: str):
    """load (fallback with the reason), inspect and verify (one message, no traceback) refuse it."""
    if (bundle / MANIFEST).is_file() and not (bundle / MANIFEST).is_symlink():   # aoti-cpu is tried first
        _edit(bundle, lambda m: _aoti(m).update(latency_ms={"cpu": {"1x128x4": 1e-3}}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya_aot.load(str(ckpt), bundle=str(bundle), device="cpu", prefer="aoti", probe=False)
    refused = dict(agent.backend_object.rejected)
    why = refused.get("aoti-cpu") or refused.get("bundle") or ""
    assert expect in why, refused
    assert getattr(agent.backend_object.artifact, "name", None) != "aoti-cpu"
    for name, argv in (("inspect", [str(bundle), "--json"]), ("verify", [str(bundle), "--checkpoint", str(ckpt)])):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = getattr(commands, name)(argv, 0.0)
        text = out.getvalue() + err.getvalue()
        assert "Traceback" not in text and "internal error" not in text, text
        flat = "".join(ch for ch in text if ch.isalnum())   # a table folds long reasons across lines
        assert "".join(ch for ch in expect if ch.isalnum()) in flat, (name, text[-2000:])
        assert rc in (1, 2) or (name == "inspect" and rc == 0), (name, rc)
    assert not _opened(secret), _opened(secret)


def _edit(bundle: Path, fn):
    m = json.loads((bundle / MANIFEST).read_text())
    fn(m)
    write_json_atomic(bundle / MANIFEST, m)


def _aoti(m):
    return next(a for a in m["artifacts"] if a["name"] == "aoti-cpu")


def test_a_symlinked_file_inside_an_artifact_is_refused(bundle_copy, demo_ckpt, secret):
    pkg = bundle_copy / "aoti-cpu" / "extra_constants.safetensors"
    pkg.unlink()
    pkg.symlink_to(secret)
    _all_three(bundle_copy, demo_ckpt, secret, "is a symbolic link")


def test_a_symlinked_artifact_file_is_refused(bundle_copy, demo_ckpt, secret):
    (bundle_copy / "onnx" / "model.onnx").unlink()
    (bundle_copy / "onnx" / "model.onnx").symlink_to(secret)
    _edit(bundle_copy, lambda m: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya_aot.load(str(demo_ckpt), bundle=str(bundle_copy), device="cpu", prefer="onnx", probe=False)
    assert agent.backend == "eager"
    assert any("symbolic link" in why for _, why in agent.backend_object.rejected), agent.backend_object.rejected
    assert not _opened(secret)


def test_a_symlinked_manifest_is_refused(bundle_copy, demo_ckpt, secret, tmp_path):
    real = tmp_path / "elsewhere.json"
    (bundle_copy / MANIFEST).rename(real)
    (bundle_copy / MANIFEST).symlink_to(real)
    _all_three(bundle_copy, demo_ckpt, secret, "not a regular file")


@pytest.mark.parametrize("path", ["/ABS", "../outside/secret.bin", "aoti-cpu/../../outside/secret.bin",
                                  "aoti-cpu/..\\..\\x"])
def test_artifact_paths_outside_the_bundle_are_refused(bundle_copy, demo_ckpt, secret, path):
    path = path.replace("/ABS", str(secret))

    def move(m):
        _aoti(m)["path"] = path
        for a in m["artifacts"]:   # leave no other artifact that could serve
            if a["name"] != "aoti-cpu":
                a["status"] = "build_failed"
    _edit(bundle_copy, move)
    _all_three(bundle_copy, demo_ckpt, secret, "a path inside the bundle")


def test_a_symlinked_artifact_directory_is_refused(bundle_copy, demo_ckpt, secret, tmp_path):
    moved = tmp_path / "moved-aoti"
    (bundle_copy / "aoti-cpu").rename(moved)
    (bundle_copy / "aoti-cpu").symlink_to(moved)
    _all_three(bundle_copy, demo_ckpt, secret, "is a symbolic link")


@pytest.mark.parametrize("bad", ["/ABS", "../../outside/secret.bin"])
def test_kernel_paths_outside_the_artifact_are_refused(bundle_copy, demo_ckpt, secret, bad):
    """TileLang's kernel files (its `details.kernels`, checked by the kind's own `check_details`): the entry is
    made a TileLang one, since only that kind keeps kernel paths."""
    bad = bad.replace("/ABS", str(secret))
    _edit(bundle_copy, lambda m: _aoti(m).update(kind="tilelang", details={"kernels": [
        {"key": "k", "status": "ok", "path": bad, "meta_path": "k.json"}]}))
    _all_three(bundle_copy, demo_ckpt, secret, "a path inside the artifact")


def test_fingerprint_file_names_outside_the_checkpoint_are_refused(bundle_copy, demo_ckpt, secret):
    _edit(bundle_copy, lambda m: m["checkpoint"]["fingerprint"]["files"].update({str(secret): "0" * 64}))
    _all_three(bundle_copy, demo_ckpt, secret, "file names inside the checkpoint")


def test_a_manifest_that_is_a_directory_or_a_fifo_is_refused(bundle_copy, demo_ckpt, secret):
    (bundle_copy / MANIFEST).unlink()
    os.mkfifo(bundle_copy / MANIFEST)   # opening a FIFO for reading would block forever
    _all_three(bundle_copy, demo_ckpt, secret, "not a regular file")

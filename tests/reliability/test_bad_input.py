"""Bad input from a careless operator: one message naming the cause and the fix, never a traceback;
and pinning the exact bundle a service deployed."""
from __future__ import annotations

import contextlib
import io
import os
import stat
import subprocess
import sys
import warnings

import pytest

import laya_aot
from laya_aot.bundle_format import bundle_sha256
from laya_aot.manifest import MANIFEST
from laya_aot.runtime.loader import NoArtifactError


def _load(ckpt, bundle, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return laya_aot.load(str(ckpt), bundle=bundle, device="cpu", **kw)


def test_bundle_none_falls_back_naming_the_fix(demo_ckpt):
    agent = _load(demo_ckpt, None)
    assert agent.backend == "eager"
    assert "pass bundle=DIR" in dict(agent.backend_object.rejected)["bundle"]
    with pytest.raises(NoArtifactError, match="pass bundle=DIR"):
        _load(demo_ckpt, None, strict=True)


def test_the_pinned_bundle_loads_and_any_other_is_refused(demo_ckpt, demo_bundle, bundle_copy, monkeypatch):
    pin = bundle_sha256(demo_bundle)
    assert _load(demo_ckpt, str(demo_bundle), prefer="aoti", bundle_sha256=pin).backend == "aot:aoti"
    # the same bundle with one manifest byte changed (a swapped artifact would need its hash changed too)
    raw = (bundle_copy / MANIFEST).read_bytes().replace(b'"laya_aot_version"', b' "laya_aot_version"', 1)
    (bundle_copy / MANIFEST).write_bytes(raw)
    agent = _load(demo_ckpt, str(bundle_copy), bundle_sha256=pin)
    assert agent.backend == "eager" and "is not the pinned bundle" in dict(agent.backend_object.rejected)["bundle"]
    with pytest.raises(NoArtifactError, match="is not the pinned bundle"):
        _load(demo_ckpt, str(bundle_copy), bundle_sha256=pin, strict=True)
    monkeypatch.setenv("LAYA_AOT_BUNDLE_SHA256", pin)   # the service's environment pins it as well
    assert _load(demo_ckpt, str(bundle_copy)).backend == "eager"
    assert _load(demo_ckpt, str(demo_bundle), prefer="aoti").backend == "aot:aoti"
    monkeypatch.setenv("LAYA_AOT_BUNDLE_SHA256", "not-a-hash")
    agent = _load(demo_ckpt, str(demo_bundle))
    assert "is not a sha256" in dict(agent.backend_object.rejected)["bundle"]


def test_inspect_prints_the_bundle_sha256(demo_bundle):
    p = subprocess.run([sys.executable, "-m", "laya_aot.cli", "inspect", str(demo_bundle), "--json"],
                       capture_output=True, text=True)
    assert p.returncode == 0 and '"bundle_sha256": "%s"' % bundle_sha256(demo_bundle) in p.stdout


def test_a_built_bundle_is_readable_by_everyone(demo_bundle):
    for root, _, files in os.walk(demo_bundle):
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o755, root
        for f in files:
            mode = stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode)
            assert mode in (0o644, 0o755), (f, oct(mode))


def _cli(*args):
    p = subprocess.run([sys.executable, "-m", "laya_aot.cli", *args], capture_output=True, text=True)
    text = p.stdout + p.stderr
    assert "Traceback" not in text, text[-3000:]
    return p.returncode, text


def test_verify_with_a_missing_checkpoint_says_so(demo_bundle, tmp_path):
    rc, text = _cli("verify", str(demo_bundle), "--checkpoint", str(tmp_path / "nope"))
    assert rc == 2 and "does not exist" in text and "e3b0c44298fc" not in text


def _cli_here(*args):
    """`laya-aot ARGS` in this process, as tests/distribution/test_safety.py runs it: the same command without
    an interpreter start (seconds on 2 cores); a traceback would fail the test as an exception."""
    from laya_aot.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    text = out.getvalue() + err.getvalue()
    assert "Traceback" not in text, text[-3000:]
    return rc, text


def test_inspect_and_verify_of_a_missing_bundle_say_so(demo_ckpt, tmp_path):
    for args in (("inspect", str(tmp_path / "nope")), ("verify", str(tmp_path / "nope"), "--checkpoint",
                                                         str(demo_ckpt))):
        rc, text = _cli_here(*args)
        assert rc == 2 and "does not exist" in text, text


@pytest.mark.slow  # a `laya-aot build` process each (it stops at the output directory, after 3-6 s of imports)
@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_an_unwritable_output_dir_is_one_message(demo_ckpt, tmp_path, where):
    # this suite runs as root in CI, where mode bits do not stop a write: a path below a regular file, and
    # /proc, refuse everyone
    if where == "under-a-file":
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "bundle"
    else:
        out = "/proc/laya-aot-bundle"
    rc, text = _cli("build", "checkpoint.path=%s" % demo_ckpt, "output_dir=%s" % out, "stages.aoti=false",
                    "stages.onnx=false")
    assert rc == 2 and "cannot write output_dir" in text and "output_dir=DIR" in text, text[-2000:]

"""`laya-aot verify` on a merged bundle: artifacts for other machines are listed as not run here, not failures."""
from __future__ import annotations

import json

from laya_aot.cli import main
from laya_aot.manifest import MANIFEST


def _edit(bundle, fn):
    m = json.loads((bundle / MANIFEST).read_text())
    fn(m)
    (bundle / MANIFEST).write_text(json.dumps(m))


def test_verify_skips_artifacts_for_another_machine_and_failed_ones(bundle_copy, demo_ckpt, capsys):
    def other_torch(m):
        for a in m["artifacts"]:
            if a["name"] == "aoti-cpu":
                a["needs"]["torch"] = "2.99.0"  # as a part built on another machine's torch
            if a["name"] == "onnx-fp32":
                a["status"] = "failed_verification"
                a["error"] = "as recorded at build"

    _edit(bundle_copy, other_torch)
    rc = main(["verify", str(bundle_copy), "--checkpoint", str(demo_ckpt), "--seed", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "not run here" in out and "2.99" in out
    assert "failed verification at build" in out
    assert "passed" in out  # the artifacts this machine can run were run


def test_verify_still_fails_an_artifact_that_runs_here_and_disagrees(bundle_copy, demo_ckpt, capsys):
    """The check can fail: a damaged artifact for this machine is a failure and a non-zero exit."""
    onnx = bundle_copy / "onnx" / "model.onnx"
    onnx.write_bytes(onnx.read_bytes()[:-10] + b"0123456789")
    rc = main(["verify", str(bundle_copy), "--checkpoint", str(demo_ckpt), "--seed", "3"])
    out = capsys.readouterr().out
    assert rc == 1 and "MISMATCH" in out

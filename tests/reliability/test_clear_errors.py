"""Mistakes that gave a traceback, an "internal error ... please report this" or a message blaming something else
(issue 55, "Why" 6): each is now one line naming its cause and its fix."""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import warnings

import pytest

import laya_aot
from laya_aot.manifest import MANIFEST
from tests.distribution.test_safety import _one_line, _run

pytest.importorskip("zstandard")


def _load(ckpt, bundle, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return laya_aot.load(str(ckpt), bundle=bundle, device="cpu", **kw)


def _clear(text: str) -> None:
    assert "Traceback" not in text and "internal error" not in text and "please report" not in text, text


@pytest.mark.parametrize("literal", ["1" + "0" * 400, "1e400", "-1" + "0" * 400])
def test_an_unbounded_verify_tolerance_rejects_its_artifact_only(small_bundle, demo_ckpt, tmp_path, literal):
    """JSON reads 10**400 as an integer no float holds: it used to escape the reader as an OverflowError and drop
    the whole bundle as an internal error."""
    bundle = tmp_path / "b"
    shutil.copytree(small_bundle, bundle)
    m = json.loads((bundle / MANIFEST).read_text())
    onnx = next(i for i, a in enumerate(m["artifacts"]) if a["kind"] == "onnx")
    m["artifacts"][onnx]["verify"]["tolerance"] = "TOLERANCE"
    (bundle / MANIFEST).write_text(json.dumps(m).replace('"TOLERANCE"', literal))
    agent = _load(demo_ckpt, str(bundle))
    why = dict(agent.backend_object.rejected)
    assert agent.backend == "eager" and "bundle" not in why, why     # only that artifact: the others still judged
    assert "verify.tolerance is inf" in why["onnx-fp32"] or "verify.tolerance is -inf" in why["onnx-fp32"], why
    _clear(str(why))
    rc, text = _run(["inspect", bundle])
    assert rc == 0 and "verify.tolerance is" in text
    _clear(text)
    # the bundle's own rule unbounded: the whole bundle is refused, by the field's name
    m["tolerance"]["fp32"] = "TOLERANCE"
    (bundle / MANIFEST).write_text(json.dumps(m).replace('"TOLERANCE"', literal))
    rc, text = _run(["inspect", bundle])
    assert rc == 2 and "invalid at tolerance.fp32" in text, text
    _clear(text)


@pytest.mark.parametrize("bundle", [123, 1.5, b"bundle", ["bundle"], {"bundle": 1}])
def test_a_bundle_argument_that_is_not_a_path_is_a_type_error_naming_it(demo_ckpt, bundle):
    with pytest.raises(TypeError, match=r"bundle=.* is not a path \(its type is \w+\); pass bundle="):
        laya_aot.load(str(demo_ckpt), bundle=bundle, device="cpu")


def test_demo_with_a_device_laya_aot_does_not_serve_is_one_line():
    rc, text = _run(["demo", "--device", "tpu"])
    assert rc == 2 and "argument --device: device 'tpu' is not one laya-aot serves; use cpu, cuda or cuda:N" in text
    _one_line(text)
    _clear(text)


def _build(*overrides: str) -> tuple:
    p = subprocess.run([sys.executable, "-m", "laya_aot.cli", "build", *overrides], capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.slow  # a `laya-aot build` process (Hydra and torch imports, then the refusal)
def test_build_with_an_unknown_demo_shape_is_one_line(tmp_path):
    rc, text = _build("checkpoint.demo_shape=nope", "output_dir=%s" % (tmp_path / "out"))
    assert rc == 2 and "checkpoint.demo_shape=nope is not a demo shape; choose one of tiny," in text, text
    _clear(text)
    assert not (tmp_path / "out").exists()


def test_an_unknown_demo_shape_names_the_setting(tmp_path):
    from laya_aot import demo
    from laya_aot.checkpoint import CheckpointError
    from laya_aot.config import CheckpointConfig

    with pytest.raises(CheckpointError, match="checkpoint.demo_shape=nope is not a demo shape; choose one of"):
        demo.resolve(CheckpointConfig(demo_shape="nope", demo_dir=str(tmp_path)))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rows", [-1, 0, 1, 10 ** 6])
def test_export_max_rows_out_of_range_is_named_not_example_rows(rows):
    from laya_aot.kinds.exported_program import example_size

    with pytest.raises(ValueError, match=r"export.max_rows=%d must be between 2 and \d+" % rows):
        example_size("cpu", rows, 256)
    with pytest.raises(ValueError, match="export.max_tokens=8 must be a multiple of 16 and at least 32"):
        example_size("cpu", 8, 8)


@pytest.mark.slow  # a `laya-aot build` process (Hydra and torch imports, then the refusal)
def test_build_with_a_negative_max_rows_blames_max_rows(demo_ckpt, tmp_path):
    rc, text = _build("checkpoint.path=%s" % demo_ckpt, "output_dir=%s" % (tmp_path / "out"), "export.max_rows=-1")
    assert rc == 2 and "export.max_rows=-1 must be between 2 and" in text and "example_rows" not in text, text
    _clear(text)


@pytest.mark.parametrize("setting, says", [
    ("export.precision=fast", "export.precision='fast': one of faithful, laya"),
    ("export.fp16_headroom=0.5", "export.fp16_headroom=0.5"),
    ("export.max_rows=-1", "export.max_rows=-1 must be between 2 and"),
    ("export.max_tokens=40", "export.max_tokens=40 must be a multiple of 16"),
    ("export.attention=flash", "export.attention='flash': one of triton, stock"),
    ("export.head=half", "export.head='half': one of answer_rows, full"),
    ("export.rotary=cached", "export.rotary='cached': one of"),
    ("export.rows=ragged", "export.rows='ragged': one of padded, packed"),
    ("export.rows=packed", "export.rows=packed is for GPU targets"),
    ("export.action_head_dtype=fp8", "unknown dtype 'fp8'"),
])
def test_a_bad_export_setting_is_named_before_the_checkpoint_is_touched(tmp_path, setting, says):
    """Every export setting is checked as the build starts: a checkpoint path that does not exist is not even
    looked at (the demo checkpoint would be made, a user's loaded: seconds to minutes before the export stage)."""
    from laya_aot.config import compose
    from laya_aot.pipeline import BuildError, build

    cfg = compose(["checkpoint.path=%s" % (tmp_path / "no-such-checkpoint"), "checkpoint.demo_shape=null",
                   "output_dir=%s" % (tmp_path / "out"), setting])
    with pytest.raises(BuildError, match=says.replace("(", r"\(")) as e:
        build(cfg)
    assert "no-such-checkpoint" not in str(e.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, says", [
    ("{oops", "invalid LAYA_EXTRA_MODELS: not JSON"),
    ('["/ckpt"]', "invalid LAYA_EXTRA_MODELS: a JSON object of checkpoint name to checkpoint directory or Hub repo "
                  "is needed, got a JSON list"),
])
def test_serve_blames_a_malformed_laya_extra_models_not_the_bundles(small_bundle, extra, says):
    from laya_aot.serve import ServeConfigError, config_from_env

    with pytest.raises(ServeConfigError) as e:
        config_from_env({"LAYA_EXTRA_MODELS": extra, "LAYA_AOT_BUNDLES": json.dumps({"demo": str(small_bundle)})})
    assert says in str(e.value) and "LAYA_AOT_BUNDLES" not in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_serve_takes_a_pack_and_a_directory_of_packs_as_load_does(small_bundle, demo_ckpt, tmp_path, caplog):
    from laya_aot import serve
    from laya_aot.distribution.pack import pack

    packs = tmp_path / "packs"
    packs.mkdir()
    file = pack(small_bundle, packs / "demo.tar.zst").path
    env = {"LAYA_EXTRA_MODELS": json.dumps({"demo": str(demo_ckpt)})}
    for bundle in (file, packs):
        config = serve.config_from_env(dict(env, LAYA_AOT_BUNDLES=json.dumps({"demo": str(bundle)})))
        spec = config.bundles["demo"]
        assert spec.bundle == str(bundle) and spec.remote
        with caplog.at_level(logging.INFO, logger="laya_aot.serve"):
            serve._precheck_lazy(type("Router", (), {"loaded": {}})(), config)
        assert "fetched by laya_aot.load" in caplog.text
        agent = _load(spec.checkpoint, spec.bundle)   # what the server's build step calls (BundleLoads)
        assert agent.backend.startswith("aot:"), agent.backend_object.rejected
    # a file that is not a pack is named as such; a missing path as before
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(serve.ServeConfigError, match="is a file but not a pack"):
        serve.config_from_env(dict(env, LAYA_AOT_BUNDLES=json.dumps({"demo": str(notes)})))


def test_merge_of_a_pack_says_to_unpack_it(small_bundle, tmp_path):
    from laya_aot.distribution.pack import pack

    file = pack(small_bundle, tmp_path / "part.tar.zst").path
    out = tmp_path / "merged"
    rc, text = _run(["merge", out, file])
    assert rc == 2 and "is a pack; merge joins bundle directories: unpack it first (`laya-aot unpack %s DIR`)" % file \
        in text, text
    _one_line(text)
    rc, text = _run(["merge", out, small_bundle, tmp_path])       # a directory of packs, beside a bundle
    assert rc == 2 and "is a directory of packs" in text, text
    _one_line(text)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".merged")]



@pytest.mark.parametrize("source", ["/nonexistent/ckpt", "./nonexistent/ckpt", "~/nonexistent-ckpt", "a/b/c"])
def test_a_mistyped_checkpoint_path_is_a_missing_directory_not_a_hub_repo(source, tmp_path):
    """A path that does not exist was read as a Hub repo id: the Hub's id check refused it and the advice was to
    download it and to set the build's checkpoint.path. It is one line naming the directory and the setting."""
    from laya_aot.checkpoint import CheckpointNotFound, locate
    from laya_aot.serve import ServeConfigError, config_from_env

    (tmp_path / MANIFEST).write_text("{}")
    with pytest.raises(ServeConfigError) as e:
        config_from_env({"LAYA_EXTRA_MODELS": json.dumps({"demo": source}),
                         "LAYA_AOT_BUNDLES": json.dumps({"demo": str(tmp_path)})})
    assert str(e.value) == "checkpoint directory %s does not exist; fix LAYA_EXTRA_MODELS['demo']" % source
    with pytest.raises(CheckpointNotFound) as e:
        locate(source)
    assert str(e.value) == "checkpoint directory %s does not exist; fix laya_aot.load's checkpoint argument" % source


def test_an_owner_name_checkpoint_is_still_a_hub_repo_with_advice_for_serve(tmp_path):
    """`owner/name` that is no directory here is a Hub repo id; the advice is serve's setting, not the build's."""
    from laya_aot.serve import ServeConfigError, config_from_env

    (tmp_path / MANIFEST).write_text("{}")
    with pytest.raises(ServeConfigError) as e:
        config_from_env({"LAYA_EXTRA_MODELS": json.dumps({"demo": "someone/ckpt"}),
                         "LAYA_AOT_BUNDLES": json.dumps({"demo": str(tmp_path)})})
    said = str(e.value)
    assert "someone/ckpt is neither a directory here nor in the local Hugging Face cache" in said, said
    assert "huggingface-cli download someone/ckpt" in said and "set LAYA_EXTRA_MODELS['demo']" in said, said
    assert "checkpoint.path" not in said and "HFValidationError" not in said, said


@pytest.mark.parametrize("hub_id", ["./ckpt", "/abs/ckpt", "~/ckpt", "a/b/c"])
def test_a_path_given_as_the_builds_hub_id_names_checkpoint_path(hub_id):
    """`checkpoint.hub_id=./x` reached the Hub's id check, and the advice was to download `./x`: it is one line
    pointing at checkpoint.path."""
    from laya_aot.checkpoint import CheckpointError, resolve
    from laya_aot.config import CheckpointConfig

    with pytest.raises(CheckpointError) as e:
        resolve(CheckpointConfig(hub_id=hub_id))
    assert str(e.value) == ("checkpoint.hub_id=%s is not a Hugging Face repo id (owner/name); for a checkpoint "
                            "directory pass checkpoint.path=%s" % (hub_id, hub_id))

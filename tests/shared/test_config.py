"""Hydra configs: groups, overrides, typed keys, a user's own --config-dir."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from laya_aot.config import compose


def test_defaults_are_the_demo_on_the_cpu():
    from laya_aot.demo import DEMO_SHAPE

    cfg = compose()
    # the trained demo checkpoint `laya-aot demo` loads (tiny, trained on synthetic tickets)
    assert cfg.checkpoint.name == "demo" and cfg.checkpoint.demo_shape == DEMO_SHAPE == "tiny-trained"
    assert cfg.target.device == "cpu" and list(cfg.target.dtypes) == []   # laya's policy: fp32 on the CPU
    assert cfg.export.action_head_dtype == "fp32"
    assert cfg.verify.tolerance.fp32 == 1e-4 and cfg.verify.tolerance.bf16 == 2e-2


def test_overrides_per_checkpoint_and_target():
    cfg = compose(["checkpoint=laya-typed-decisions", "target=sm_90", "export.max_rows=128"])
    assert cfg.checkpoint.subfolder == "typed-decisions" and cfg.checkpoint.max_len == 1024
    assert cfg.target.arch == "sm_90" and cfg.target.tilelang_archs == ["sm_90a"]
    assert cfg.export.max_rows == 128 and isinstance(cfg.export.max_rows, int)
    for arch in ("sm_80", "sm_86", "sm_89"):
        assert compose(["target=%s" % arch]).target.device == "cuda"


@pytest.mark.parametrize("override, key", [("export.max_rowz=3", "max_rowz"), ("stagez.aoti=false", "stagez")])
def test_mistyped_key_is_an_error_naming_it(override, key):
    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        compose([override])
    assert key in str(e.value) + str(e.value.__cause__)


def test_wrong_type_is_an_error_naming_the_key():
    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        compose(["export.max_rows=lots"])
    assert "max_rows" in str(e.value) + str(e.value.__cause__)


def test_cli_reports_a_mistyped_key_and_exits_nonzero(tmp_path):
    p = subprocess.run([sys.executable, "-m", "laya_aot.cli", "build", "export.max_rowz=3"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode != 0
    assert "max_rowz" in p.stderr + p.stdout
    assert not (tmp_path / "artifacts").exists()


def test_user_config_dir_adds_a_checkpoint_with_its_own_overrides(tmp_path, demo_ckpt):
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "my-finetune.yaml").write_text(textwrap.dedent("""
        defaults:
          - base_checkpoint
        name: my-finetune
        path: %s
        max_len: 128
        """ % demo_ckpt))
    cfg = compose(["checkpoint=my-finetune", "export.max_markers=8"], config_dir=str(tmp_path))
    assert cfg.checkpoint.name == "my-finetune" and cfg.checkpoint.max_len == 128
    p = subprocess.run([sys.executable, "-m", "laya_aot.cli", "build", "--config-dir", str(tmp_path),
                        "checkpoint=my-finetune", "--cfg", "job"], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "my-finetune" in p.stdout and "max_len: 128" in p.stdout

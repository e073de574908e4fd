"""The README's commands are what CI runs."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _commands():
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [line for b in blocks for line in b.splitlines() if line.startswith("python3 -m venv")]


def test_ci_runs_the_readme_test_commands():
    setup, *tests = _commands()
    assert "laya-aot demo" in setup
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m venv")]
    assert ci == tests, "the README's test commands and .ci/run differ"
    full, serve = tests
    assert "tilelang" in full and "tilelang" not in serve and '-e ".[serve]"' in serve, \
        "CI's second environment is serving as the README installs it, without the tilelang extra"


def test_getting_started_is_one_screen_with_the_readmes_first_command():
    page = (ROOT / "docs" / "getting-started.md").read_text()
    setup = _commands()[0]
    assert re.findall(r"```bash\n(?:#.*\n)*(.*)\n```", page) == [setup], "docs/getting-started.md and command 1 differ"
    assert len(page.splitlines()) <= 40, "getting started is one screen"

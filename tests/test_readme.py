"""The README's commands are what CI runs."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands():
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [line for b in blocks for line in b.splitlines() if line.startswith("python3 -m venv")]


def test_ci_runs_the_readme_test_command():
    setup, tests = _commands()[:2]
    assert "laya-aot demo" in setup
    assert tests in (ROOT / ".ci" / "run").read_text()

"""The README's two commands are the ones that work: CI runs the test command verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    return [b.strip() for b in blocks if "python3 -m venv" in b]


def test_readme_has_a_serve_command_and_a_test_command():
    serve, test = readme_commands()[:2]
    assert serve.endswith("fovea serve")
    assert "'.[test]'" in test and test.endswith("pytest -q")


def test_ci_runs_the_readme_test_command():
    test_command = readme_commands()[1]
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()

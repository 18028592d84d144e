"""ruff, as configured in pyproject.toml: the lint rules pass and every file is formatted."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_passes(command):
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, (
        f"ruff {' '.join(command)} (fix with: .venv/bin/ruff {command[0]} "
        f"{'--fix ' if command == ['check'] else ''}.):\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
    )

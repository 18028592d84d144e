"""The README's Python example runs as written, in a fresh process, and trains only adapters."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_readme_layers_example_runs():
    (example,) = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    check = (
        "\nfrozen = [p for p in model.parameters() if not p.requires_grad]\n"
        "assert frozen and all(p.grad is None for p in frozen)\n"
        "assert all(p.grad is not None for p in mm.slot_parameters(model, 0))\n"
        "assert all(p.grad is None for p in mm.slot_parameters(model, 1))  # no tokens\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", example + check],
        cwd=REPO,
        timeout=240,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]

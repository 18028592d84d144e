"""The README's Python example runs as written, in a fresh process, and trains only adapters;
its model table names every family."""

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


def test_every_family_has_its_row_in_the_readme_model_table():
    """The model table names each registered model type outside its "not yet" row (a new
    family's module, registry line and README row go together)."""
    from megatron_multilora.models.families import FAMILIES

    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("| family (`model_type`) |") :]
    rows = [line for line in table[: table.index("\n\n")].splitlines() if "not yet" not in line]
    missing = [t for t in FAMILIES if not any(f"`{t}`" in row for row in rows)]
    assert not missing, f"README's model table lacks {missing}"

"""What a command-line run that ends badly tells the caller: its exit status and last lines."""

import subprocess
import sys

from tests.recipe.conftest import QUIET, ROOT, job, launch_env


def test_a_run_with_a_failed_job_exports_the_others_and_exits_non_zero(demo_data, tmp_path):
    jobs = [
        job("rev", demo_data, "reverse", 3),
        job("boom", demo_data, "sort", 3, lr=1e30, grad_clip="null"),
    ]
    env = launch_env()
    proc = subprocess.run(
        [
            sys.executable,
            "recipes/multi_lora_finetune.py",
            *QUIET,
            f"run_dir={tmp_path / 'run'}",
            f"adapters=[{','.join(jobs)}]",
            "lora.slots=2",
            "trainer.max_bad_steps=1",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == (
        "1 of 2 adapter jobs FAILED: boom (see the job lines above); the others were exported"
    ), proc.stdout[-3000:]
    assert lines[-2].startswith("job boom: FAILED after ") and lines[-2].endswith("-> -")
    assert (tmp_path / "run" / "adapters" / "rev" / "adapter_config.json").is_file()
    assert not (tmp_path / "run" / "adapters" / "boom").exists()
    # The run's config is recorded once it is valid (Hydra itself writes nothing).
    assert (tmp_path / "run" / "hydra" / "config.yaml").is_file()

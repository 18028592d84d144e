"""A stop is always said, wherever the signal lands: before the workers start, while they set
up, twice during a step (Ctrl-C pressed twice: torchrun then SIGTERMs its workers), and during
the final evaluation; never a traceback or a logging error.

Each test first waits for the state it claims (the handler in place, the run in its final
evaluation) and checks the line that only that state prints."""

import os
import signal
import time
from pathlib import Path

import psutil

from megatron_multilora.training.mailbox import folder
from tests.recipe.test_cli import MMLORA, command, launch, wait_for_step

NOISE = ("Traceback", "Logging error")


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (sig - 1) & 1)


def wait_until(condition, proc, log: Path, timeout: float = 240):
    deadline = time.time() + timeout
    while not (value := condition()):
        assert proc.poll() is None, f"run ended early:\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, f"timed out:\n{log.read_text()[-3000:]}"
        time.sleep(0.01)
    return value


def recipe_workers(proc) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "multi_lora_finetune.py" in " ".join(p.cmdline())
    ]


def stopped(proc, log: Path, code: int) -> str:
    assert proc.wait(timeout=120) == code, log.read_text()[-3000:]
    out = log.read_text()
    assert not any(noise in out for noise in NOISE), out[-3000:]
    return out


def test_a_signal_before_the_workers_start_ends_the_launch_with_its_line(demo_data, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = launch([MMLORA, "train", "--nproc", "2", *command(run_dir, demo_data)[5:]], log)
    wait_until(lambda: catches(proc.pid, signal.SIGTERM), proc, log)  # its checks are running
    proc.send_signal(signal.SIGTERM)
    out = stopped(proc, log, 128 + signal.SIGTERM)
    assert "mmlora train: stopped by SIGTERM before the workers started; nothing ran" in out
    assert not run_dir.exists()  # no worker ever ran


def test_a_signal_while_the_workers_set_up_ends_them_at_once_with_the_line(demo_data, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = launch([MMLORA, "train", "--nproc", "2", *command(run_dir, demo_data)[5:]], log)
    workers = wait_until(lambda: len(w := recipe_workers(proc)) == 2 and w, proc, log)
    wait_until(lambda: all(catches(w.pid, signal.SIGTERM) for w in workers), proc, log)
    os.killpg(proc.pid, signal.SIGTERM)
    out = stopped(proc, log, 128 + signal.SIGTERM)
    assert "stopped by SIGTERM before it could save: run the same command" in out, out[-3000:]
    assert "starting at step" not in out  # setup never finished


def test_ctrl_c_twice_during_training_still_says_the_stop(demo_data, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = launch([MMLORA, "train", "--nproc", "2", *command(run_dir, demo_data)[5:]], log)
    wait_for_step(proc, run_dir, 2, log)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # impatience: torchrun now SIGTERMs the workers
    out = stopped(proc, log, 128 + signal.SIGINT)
    # Rank 0 says either where it saved (the first signal's stop was quicker) or that it
    # stopped before it could.
    assert "stopped by SIGINT after step" in out or "stopped by SIGTERM before it could save" in out
    assert out.rstrip().endswith(
        "mmlora train: stopped by SIGINT (the workers' last line says "
        "where they stopped and how to resume)"
    ), out[-3000:]


def test_a_signal_during_the_final_evaluation_says_nothing_is_lost(demo_data, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    # Every adapter on every task with 200 generated tokens: seconds of final evaluation.
    extra = ["trainer.eval_samples=64", "trainer.max_new_tokens=200"]
    overrides = command(run_dir, demo_data, extra, steps=4, save_every=1000)[5:]
    proc = launch([MMLORA, "train", "--nproc", "2", *overrides], log)
    wait_until(
        lambda: (status := folder.read_status(run_dir)) and status["state"] == "finished",
        proc,
        log,
    )
    os.killpg(proc.pid, signal.SIGTERM)
    out = stopped(proc, log, 128 + signal.SIGTERM)
    assert "stopped by SIGTERM after saving: nothing is lost" in out, out[-3000:]
    assert "held-out loss of each adapter" not in out  # the tables were cut short
    assert (run_dir / "adapters" / "rev" / "adapter_config.json").is_file()

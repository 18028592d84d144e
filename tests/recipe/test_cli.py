"""The recipe as users run it: torchrun from the command line with Hydra overrides.

One uninterrupted run (which also checks every output a run leaves); one whose torchrun and
workers are SIGKILLed mid-way, which is resumed, stopped with SIGTERM (it saves where it
stops) and resumed again to the end (identical loss trajectory), and also resumed under
another TP layout; and a Hydra multirun.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_multilora.training.report.metrics import read_metrics
from tests.recipe.conftest import ROOT, job, launch_env, losses_by_adapter

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
MMLORA = str(Path(sys.executable).parent / "mmlora")
STEPS, SAVE_EVERY = 120, 20


def command(
    run_dir: Path,
    demo: Path | None,
    extra: list[str] = (),
    nproc: int = 2,
    steps: int = STEPS,
    jobs: list[str] | None = None,
    save_every: int = SAVE_EVERY,
) -> list[str]:
    """The launch command; ``jobs`` (Hydra job values) default to two on ``demo``'s tasks."""
    # warmup then decay: a resume that restored the wrong learning rate changes the trajectory
    jobs = (
        jobs
        if jobs is not None
        else [
            job("rev", demo, "reverse", steps, warmup_steps=10),
            job("add", demo, "add", steps, schedule="linear", warmup_steps=5),
        ]
    )
    return [
        TORCHRUN,
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--local-ranks-filter=0",
        "recipes/multi_lora_finetune.py",
        f"run_dir={run_dir}",
        "hf_dir=null",
        f"adapters=[{','.join(jobs)}]",
        "lora.slots=2",
        "model.hidden_size=64",
        "model.ffn_hidden_size=128",
        "trainer.log_interval=1",
        "trainer.eval_interval=0",
        "trainer.micro_batch_tokens=512",
        f"checkpoint.save_interval={save_every}",
        "logging.wandb_mode=disabled",
        "logging.plots=false",
        *extra,
    ]


def launch(cmd: list[str], log: Path, cwd: Path = ROOT) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=launch_env(),
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, log: Path, timeout: float = 300) -> str:
    rc = proc.wait(timeout=timeout)
    out = log.read_text()
    assert rc == 0, f"run failed (exit {rc}):\n{out[-3000:]}"
    return out


def last_train_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    steps = [r["step"] for r in read_metrics(path) if r["kind"] == "train"] if path.exists() else []
    return max(steps, default=0)


def wait_for_step(
    proc: subprocess.Popen, run_dir: Path, step: int, log: Path
) -> list[psutil.Process]:
    """Wait until the run has logged ``step``; returns its worker processes."""
    deadline = time.time() + 240
    while last_train_step(run_dir) < step:
        assert proc.poll() is None, f"run ended early:\n{log.read_text()[-2000:]}"
        assert time.time() < deadline, "the run did not progress"
        time.sleep(0.05)
    workers = psutil.Process(proc.pid).children(recursive=True)
    assert len([w for w in workers if "multi_lora_finetune.py" in " ".join(w.cmdline())]) == 2
    return workers


def latest_step(run_dir: Path) -> int:
    return json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"]


@pytest.fixture(scope="module")
def whole(demo_data, tmp_path_factory) -> tuple[Path, str]:
    """The uninterrupted run, every output on, launched as users do, with ``mmlora train``
    from a folder outside the checkout: (run_dir, console output)."""
    tmp = tmp_path_factory.mktemp("whole")
    overrides = command(
        tmp / "run",
        demo_data,
        ["logging.plots=true", "logging.wandb_mode=offline", "trainer.eval_interval=60"],
    )[5:]
    # Hydra's own flags pass through; --nproc may come anywhere.
    out = finish(
        launch(
            [MMLORA, "train", "--config-name", "config", *overrides, "--nproc", "2"],
            tmp / "run.log",
            cwd=tmp,
        ),
        tmp / "run.log",
    )
    assert "mmlora train: torchrun --standalone --nproc-per-node 2" in out
    return tmp / "run", out


@pytest.fixture(scope="module")
def killed(demo_data, tmp_path_factory) -> tuple[Path, int, int]:
    """A run whose torchrun and workers (they run in sessions of their own) were SIGKILLed
    mid-way, as a crash would: (run_dir, its last checkpoint's step, its last logged step).
    Tests resume copies of it."""
    tmp = tmp_path_factory.mktemp("killed")
    proc = launch(command(tmp / "run", demo_data), tmp / "run.log")
    processes = [
        psutil.Process(proc.pid),
        *wait_for_step(proc, tmp / "run", 2 * SAVE_EVERY + 5, tmp / "run.log"),
    ]
    for p in processes:
        p.send_signal(signal.SIGKILL)
    proc.wait()
    _, alive = psutil.wait_procs(processes, timeout=30)
    assert not alive, f"still running after SIGKILL: {alive}"
    stopped_at, saved = last_train_step(tmp / "run"), latest_step(tmp / "run")
    assert SAVE_EVERY <= saved < stopped_at < STEPS, (saved, stopped_at)
    return tmp / "run", saved, stopped_at


def test_uninterrupted_run_leaves_every_output(whole):
    run_dir, out = whole
    assert "held-out loss of each adapter" in out and "job rev: done after 120 steps" in out
    for name in ("rev", "add"):
        config = json.loads((run_dir / "adapters" / name / "adapter_config.json").read_text())
        assert config["format"] == "megatron-multilora-adapter" and config["steps"] == STEPS
        assert (run_dir / "adapters" / name / "adapter.safetensors").stat().st_size > 0
    assert (run_dir / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "adapter_task_loss.png").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*"))
    records = read_metrics(run_dir / "metrics.jsonl")
    assert {r["kind"] for r in records} == {"train", "eval"}
    assert latest_step(run_dir) == STEPS


def test_killed_run_resumes_stops_on_sigterm_and_resumes_again_identically(
    whole, killed, demo_data, tmp_path
):
    run_dir, saved, stopped_at = tmp_path / "run", *killed[1:]
    shutil.copytree(killed[0], run_dir)
    # Resume with `mmlora train`, then stop it with SIGTERM to the launcher (what a scheduler
    # or `kill` sends; Ctrl-C's SIGINT takes the same path): torchrun passes it to the
    # workers, which finish the step, save it and exit.
    log = tmp_path / "resume.log"
    proc = launch([MMLORA, "train", "--nproc", "2", *command(run_dir, demo_data)[5:]], log)
    workers = wait_for_step(proc, run_dir, stopped_at + 10, log)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM  # torchrun SIGKILLs workers after 30 s
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, f"workers still running after torchrun ended: {alive}"
    out = log.read_text()
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{saved:08d}'} at step {saved}" in out
    stop = latest_step(run_dir)
    assert stopped_at + 10 <= stop < STEPS and last_train_step(run_dir) == stop
    assert f"stopped by SIGTERM after step {stop}; checkpoint {run_dir / 'checkpoints'}" in out, (
        out[-3000:]
    )
    # The launch ends in one line that reads as a stop, not in torchrun's traceback.
    assert out.rstrip().endswith(
        "mmlora train: stopped by SIGTERM (the workers' last line says "
        "where they stopped and how to resume)"
    ), out[-3000:]
    assert "Traceback" not in out, out[-3000:]

    log = tmp_path / "resume2.log"
    out = finish(launch(command(run_dir, demo_data), log), log)
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stop:08d}'} at step {stop}" in out
    want, got = losses_by_adapter(whole[0]), losses_by_adapter(run_dir)
    for name in ("rev", "add"):
        assert len(got[name]) == STEPS  # logged steps after each checkpoint were dropped, rerun
        assert got[name] == want[name], f"{name}: resumed trajectory differs"


def test_sigterm_to_one_worker_stops_every_rank_and_torchrun_names_the_stop(demo_data, tmp_path):
    """A scheduler may signal the workers rather than torchrun: the signalled rank's stop is
    agreed by all at the step boundary, and torchrun's summary shows the stop line as its
    root cause instead of a bare exit code."""
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = launch(command(run_dir, demo_data, save_every=1000), log)
    workers = wait_for_step(proc, run_dir, 2, log)
    rank1 = next(
        w
        for w in workers
        if "multi_lora_finetune.py" in " ".join(w.cmdline()) and w.environ().get("RANK") == "1"
    )
    rank1.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) != 0
    out = log.read_text()
    stop = latest_step(run_dir)
    assert 2 <= stop < STEPS and last_train_step(run_dir) == stop
    line = f"stopped by SIGTERM after step {stop}; checkpoint {run_dir / 'checkpoints'}"
    assert line in out, out[-3000:]  # rank 0's own line: it stopped at the same boundary
    assert f"traceback : {line}" in out, out[-3000:]


def test_killed_run_resumes_under_another_tp_layout(whole, killed, demo_data, tmp_path):
    """The checkpoint under TP=2 + SP (dp 1) in the fully sharded mode: adapters and Adam
    moments reshard, A and B split over the TP ranks as well."""
    run_dir, saved = tmp_path / "run", killed[1]
    shutil.copytree(killed[0], run_dir)
    finish(
        launch(
            command(run_dir, demo_data, ["parallel=tp2", "lora.fully_sharded=true"]),
            tmp_path / "tp2.log",
        ),
        tmp_path / "tp2.log",
    )
    want, got = losses_by_adapter(whole[0]), losses_by_adapter(run_dir)
    for name in ("rev", "add"):
        assert got[name][:saved] == want[name][:saved]
        # The first step after resuming sees exactly the saved adapters; later steps drift
        # at float-rounding level, which Adam amplifies where gradients are ~0.
        first = abs(got[name][saved] - want[name][saved]) / want[name][saved]
        assert first < 1e-6, f"{name}: first step after a TP=2 resume differs by {first:.2e}"
        worst = max(abs(g - w) / w for g, w in zip(got[name][saved:], want[name][saved:]))
        assert worst < 5e-3, f"{name}: TP=2 resume drifts by {worst:.2e}"


def test_multirun_sweeps_into_separate_run_dirs(demo_data, tmp_path):
    cmd = [
        sys.executable,
        "recipes/multi_lora_finetune.py",
        "-m",
        "seed=1,2",
        *command(tmp_path / "sweep", demo_data, steps=3)[5:],
    ]
    out = finish(launch(cmd, tmp_path / "multirun.log"), tmp_path / "multirun.log")
    for n in ("0", "1"):
        run = tmp_path / "sweep-multirun" / n
        assert (run / "adapters" / "rev" / "adapter_config.json").is_file(), out[-2000:]
    first = losses_by_adapter(tmp_path / "sweep-multirun" / "0")["rev"]
    second = losses_by_adapter(tmp_path / "sweep-multirun" / "1")["rev"]
    assert first != second  # the seeds differ

"""Serve mode from the command line: jobs submitted into a running torchrun launch with
`mmlora submit`, cancelled with `mmlora cancel`, the run stopped with `mmlora stop`, a job
submitted while the trainer is down, a SIGKILL after a submission and its resume.
"""

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from safetensors.torch import load_file

from megatron_multilora.training.mailbox import folder
from megatron_multilora.training.report.metrics import read_metrics
from tests.recipe.conftest import job, job_fields, losses_by_adapter
from tests.recipe.test_cli import ROOT, finish, last_train_step, latest_step
from tests.recipe.test_cli import command as launch_command
from tests.recipe.test_cli import launch as launch_run


@pytest.fixture
def launch():
    """``launch(cmd, log)``; whatever a test launched is killed at its end (a serving run
    never ends by itself, and a failed test must not leave one training)."""
    started = []

    def start(cmd: list[str], log: Path) -> subprocess.Popen:
        started.append(launch_run(cmd, log))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            victims = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            for p in victims:
                p.kill()
            psutil.wait_procs(victims, timeout=30)


def command(
    run_dir: Path, jobs: list[str], extra: list[str] = (), save_every: int = 5
) -> list[str]:
    return launch_command(
        run_dir, None, ["trainer.serve_poll_seconds=0.5", *extra], jobs=jobs, save_every=save_every
    )


def mmlora(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_multilora.cli", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def spec(folder: Path, name: str, demo: Path, task: str, steps: int, **extra) -> Path:
    """A job spec file for `mmlora submit` (the fields of an ``adapters`` entry)."""
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job_fields(name, demo, task, steps, **extra)))
    return path


def submit(run_dir: Path, path: Path) -> str:
    done = mmlora("submit", "--run-dir", run_dir, path)
    assert done.returncode == 0, done.stderr
    return done.stdout


def wait_for(what, proc: subprocess.Popen, log: Path, timeout: float = 240):
    """Poll ``what()`` until it returns something truthy, while the run is alive."""
    deadline = time.time() + timeout
    while not (found := what()):
        assert proc.poll() is None, f"run ended early:\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, f"timed out waiting:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)
    return found


def event_step(run_dir: Path, kind: str, name: str) -> int | None:
    return next(
        (
            e["step"]
            for e in folder.read_events(run_dir)
            if e["event"] == kind and e["name"] == name
        ),
        None,
    )


def refusals(run_dir: Path) -> dict[str, str]:
    """The refused submissions' reasons, by name."""
    return {e["name"]: e["reason"] for e in folder.read_events(run_dir) if e["event"] == "refuse"}


def status(run_dir: Path) -> dict:
    return folder.read_status(run_dir)


def job_row(run_dir: Path, name: str) -> dict:
    return next(j for j in status(run_dir)["jobs"] if j["name"] == name)


def first_step(run_dir: Path, name: str) -> int:
    return min(
        r["step"]
        for r in read_metrics(run_dir / "metrics.jsonl")
        if r["kind"] == "train" and name in r["adapters"]
    )


def workers(proc: subprocess.Popen) -> list[psutil.Process]:
    found = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "multi_lora_finetune.py" in " ".join(p.cmdline())
    ]
    assert len(found) == 2, found
    return found


def test_submitted_job_trains_as_a_config_job_queued_for_that_step_even_across_a_kill(
    demo_data, tmp_path, launch
):
    rev = job("rev", demo_data, "reverse", 300, warmup_steps=10)
    served, log = tmp_path / "served", tmp_path / "served.log"
    # No periodic checkpoint: the only one is `mmlora stop`'s, written before the job exists,
    # so whatever step the trainer takes the submission at, the kill below falls between the
    # submission and any checkpoint that holds it (a periodic save could land in that gap).
    save_every = 10_000
    cmd = command(served, [rev], save_every=save_every)
    proc = launch(cmd, log)
    wait_for(lambda: last_train_step(served) >= 3, proc, log)
    assert mmlora("stop", "--run-dir", served).returncode == 0
    finish(proc, log)
    saved = latest_step(served)
    proc, log = launch(cmd, tmp_path / "restarted.log"), tmp_path / "restarted.log"
    wait_for(lambda: last_train_step(served) > saved, proc, log)
    submit(served, spec(tmp_path, "add", demo_data, "add", 40, schedule="linear", warmup_steps=5))
    k = wait_for(lambda: event_step(served, "add", "add"), proc, log)
    # SIGKILL torchrun and both workers, as a crash would, at a random step after the job was
    # added: the resumed run must take it from the journal.
    kill_at = random.randint(k + 2, k + 30)
    wait_for(lambda: last_train_step(served) >= kill_at, proc, log)
    victims = [psutil.Process(proc.pid), *workers(proc)]
    for p in victims:
        p.send_signal(signal.SIGKILL)
    _, alive = psutil.wait_procs(victims, timeout=30)
    assert not alive, alive
    killed_at = last_train_step(served)
    assert latest_step(served) == saved < k < killed_at < 300, (saved, k, kill_at, killed_at)
    out = finish(launch(cmd, tmp_path / "resumed.log"), tmp_path / "resumed.log")
    assert f"resumed from {served / 'checkpoints'}" in out and f"at step {saved}" in out

    # The same two jobs from the config, the second queued to start at step k: uninterrupted.
    queued = tmp_path / "queued"
    add = job("add", demo_data, "add", 40, schedule="linear", warmup_steps=5, start_step=k)
    finish(
        launch(command(queued, [rev, add], save_every=save_every), tmp_path / "queued.log"),
        tmp_path / "queued.log",
    )
    got, want = losses_by_adapter(served), losses_by_adapter(queued)
    assert set(got) == {"rev", "add"} and len(got["add"]) == 40 and len(got["rev"]) == 300
    assert first_step(served, "add") == first_step(queued, "add") == k + 1
    assert got == want  # every loss of both jobs, bit for bit
    for name in ("rev", "add"):
        a = load_file(served / "adapters" / name / "adapter.safetensors")
        b = load_file(queued / "adapters" / name / "adapter.safetensors")
        assert a.keys() == b.keys() and all((a[key] == b[key]).all() for key in a), name
    # The end-of-run adapter x task table has the submitted job's row and column.
    assert "add" in out.split("held-out loss of each adapter")[1].splitlines()[1]


def test_cancel_hands_the_slot_on_stop_checkpoints_and_a_job_submitted_while_down_starts_on_resume(
    demo_data, tmp_path, launch
):
    run, log = tmp_path / "served", tmp_path / "served.log"
    rev = job("rev", demo_data, "reverse", 100_000)  # trains until cancelled
    cmd = command(run, [rev], ["trainer.serve=true"])
    proc = launch(cmd, log)
    wait_for(lambda: last_train_step(run) >= 3, proc, log)
    submit(run, spec(tmp_path, "add", demo_data, "add", 100_000))
    submit(run, spec(tmp_path, "up", demo_data, "uppercase", 30))
    # Both slots taken (a status written between add's admission and its start may show it
    # queued for a moment, so wait for the settled rows).
    wait_for(
        lambda: (
            {j["name"]: j["status"] for j in status(run)["jobs"]}
            == {"rev": "active", "add": "active", "up": "queued"}
        ),
        proc,
        log,
    )

    # Submissions the trainer finds broken (written past `mmlora submit`, whose checks would
    # refuse them: a missing dataset, a reserved name) are refused and journaled; training
    # goes on.
    folder.submit(run, {"name": "ghost", "dataset": str(tmp_path / "gone.jsonl"), "max_steps": 5})
    folder.submit(run, job_fields("base", demo_data, "add", 5))
    refused = wait_for(lambda: (r := refusals(run)).keys() >= {"ghost", "base"} and r, proc, log)
    assert "gone.jsonl" in refused["ghost"] and "name='base': reserved" in refused["base"]
    assert not {"ghost", "base"} & {j["name"] for j in status(run)["jobs"]}

    cancelled = mmlora("cancel", "--run-dir", run, "add")
    assert cancelled.returncode == 0, cancelled.stderr
    c = wait_for(lambda: event_step(run, "cancel", "add"), proc, log)
    wait_for(lambda: last_train_step(run) > c + 1, proc, log)
    assert first_step(run, "up") == c + 1  # it took add's slot at the same boundary
    meta = json.loads((run / "adapters" / "add" / "adapter_config.json").read_text())
    assert meta["cancelled"] is True and meta["finished"] is False
    assert meta["steps"] == c - event_step(run, "add", "add")
    assert job_row(run, "add")["status"] == "cancelled"

    stopped = mmlora("stop", "--run-dir", run)
    assert stopped.returncode == 0, stopped.stderr
    out = finish(proc, log)  # exit status 0: a requested stop is not an error
    s = latest_step(run)
    assert "stopped on request (mmlora stop)" in out and s == last_train_step(run) > c + 1
    # It ends as a training run does: the tables of the exported adapters (add, cancelled)
    # beside the base, a line per job; rev and up resume from the checkpoint.
    assert "held-out loss of each adapter (row) on each job's data (column)" in out
    assert "job rev: UNFINISHED" in out and "(mmlora stop), resumes from the checkpoint" in out
    assert status(run)["state"] == "stopped" and not (run / "serve" / "stop").exists()

    # Submitted while the trainer is down: listed as waiting, added when the run resumes.
    submit(run, spec(tmp_path, "sort", demo_data, "sort", 12))
    listed = mmlora("status", "--run-dir", run)
    assert listed.returncode == 0 and "sort" in listed.stdout and "submitted" in listed.stdout
    proc, log = launch(cmd, tmp_path / "resumed.log"), tmp_path / "resumed.log"
    assert wait_for(lambda: event_step(run, "add", "sort"), proc, log) == s
    assert mmlora("cancel", "--run-dir", run, "rev").returncode == 0
    # Every job ends; the serving trainer then waits, idle, without burning CPU.
    wait_for(lambda: status(run)["state"] == "idle", proc, log)
    rows = {j["name"]: j for j in status(run)["jobs"]}
    assert [rows[n]["status"] for n in ("rev", "add", "up", "sort")] == [
        "cancelled",
        "cancelled",
        "done",
        "done",
    ]
    assert rows["sort"]["steps_done"] == 12 and rows["up"]["steps_done"] == 30
    idle = workers(proc)
    before = [sum(p.cpu_times()[:2]) for p in idle]
    time.sleep(4)
    used = [sum(p.cpu_times()[:2]) - b for p, b in zip(idle, before)]
    assert max(used) < 0.4, f"idle workers used {used} CPU seconds in 4 s"
    assert mmlora("stop", "--run-dir", run).returncode == 0
    finish(proc, log)
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, steps[-1] + 1)), "a step lost or logged twice across the stop"

"""Resuming in-process (world of one): damaged checkpoints, leftovers of killed writes, a missing
``latest.json``, starting over in a used run_dir, an explicit older checkpoint, and a stop
signal. Every resumed run must log exactly the uninterrupted run's records, once."""

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

import megatron_multilora as mm
from megatron_multilora.checkpoint.files import verify_manifest
from megatron_multilora.training.checkpoints import CheckpointError
from megatron_multilora.training.mailbox import folder
from megatron_multilora.training.report.metrics import read_metrics
from megatron_multilora.training.stop import RunStopped, stop_on_signals
from tests.recipe.conftest import QUIET, compose_run, job, losses_by_adapter, run_in_process

# Jobs of 8 steps stopped at trainer step 6: the last checkpoint still holds both slots.
SAVES = ["checkpoint.save_interval=2", "checkpoint.keep_last=3", "trainer.max_steps=6"]


def jobs(demo: Path) -> list[str]:
    # warmup + cosine: a resume that restored the wrong lr would change the trajectory
    return [
        job(name, demo, task, 8, warmup_steps=3, schedule="cosine")
        for name, task in (("rev", "reverse"), ("add", "add"))
    ]


@pytest.fixture(scope="module")
def finished(demo_data, tmp_path_factory) -> Path:
    """An uninterrupted run: checkpoints at steps 2, 4 and 6."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    run_in_process(run_dir, jobs(demo_data), SAVES)
    return run_dir


def copy_of(finished: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    return run_dir


def records(run_dir: Path) -> list[tuple]:
    """Every metrics record but its timings."""
    return [
        (
            r["step"],
            r["kind"],
            {
                name: {k: v for k, v in metrics.items() if not k.endswith("tokens_per_s")}
                for name, metrics in r["adapters"].items()
            },
        )
        for r in read_metrics(run_dir / "metrics.jsonl")
    ]


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def resume(run_dir: Path, demo: Path, capsys, overrides: list[str] = ()) -> str:
    capsys.readouterr()
    run_in_process(run_dir, jobs(demo), [*SAVES, *overrides])
    return capsys.readouterr().out


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garble(path: Path, at: int) -> None:
    """Flip 16 bytes at offset ``at`` (negative: from the end); the size stays."""
    data = bytearray(path.read_bytes())
    for i in range(at, at + 16):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated tensors": ("job.rev.safetensors", truncate),
    "garbled tensor bytes": ("job.add.safetensors", lambda p: garble(p, -40)),
    "garbled pickle": ("state.pt", lambda p: garble(p, 200)),
    "garbled manifest": ("manifest.json", lambda p: p.write_text('{"files": {"state.pt": ')),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(
    kind, finished, demo_data, tmp_path, capsys
):
    run_dir = copy_of(finished, tmp_path)
    name, damage = DAMAGE[kind]
    damage(step_dir(run_dir, 6) / name)
    damaged_bytes = (step_dir(run_dir, 6) / name).read_bytes()

    out = resume(run_dir, demo_data, capsys)
    assert str(step_dir(run_dir, 6) / name) in out  # the message names the file
    assert f"resumed from {step_dir(run_dir, 4)} at step 4" in out
    # steps 5 and 6 ran again, exactly as before, and were logged once
    assert records(run_dir) == records(finished)
    # the damaged checkpoint is kept aside, not overwritten or pruned; a new step 6 was written
    aside = run_dir / "checkpoints" / "set_aside" / "step_00000006"
    assert f"moved to {aside}" in out and (aside / name).read_bytes() == damaged_bytes
    verify_manifest(step_dir(run_dir, 6))
    assert json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"] == 6


def test_missing_latest_json_and_leftovers_of_killed_writes(finished, demo_data, tmp_path, capsys):
    run_dir = copy_of(finished, tmp_path)
    root = run_dir / "checkpoints"
    (root / "latest.json").unlink()
    # what writes killed at each stage leave: a half-filled temp folder, a temp latest.json,
    # a replaced folder not yet deleted, and one whose replacement never arrived
    (root / ".step_00000008.tmp-k1ll").mkdir()
    (root / ".step_00000008.tmp-k1ll" / "state.pt").write_bytes(b"half")
    (root / ".latest.json.tmp-k1ll").write_text('{"step": 8')
    shutil.copytree(step_dir(run_dir, 4), root / ".step_00000004.old-123")
    os.replace(step_dir(run_dir, 2), root / ".step_00000002.old-456")

    out = resume(run_dir, demo_data, capsys, ["trainer.max_steps=8", "checkpoint.keep_last=5"])
    assert out.count(f"{root / 'latest.json'} is missing") == 1
    assert f"resumed from {step_dir(run_dir, 6)} at step 6" in out
    for name in (".step_00000008.tmp-k1ll", ".latest.json.tmp-k1ll", ".step_00000004.old-123"):
        assert f"{root / name}: removed" in out
    assert sorted(p.name for p in root.iterdir()) == [
        "latest.json",
        "step_00000002",
        "step_00000004",
        "step_00000006",
        "step_00000008",
    ]
    verify_manifest(step_dir(run_dir, 2))  # put back
    got, want = losses_by_adapter(run_dir), losses_by_adapter(finished)
    assert all(got[n][:6] == want[n] and len(got[n]) == 8 for n in want)  # 6 once, then 7, 8


def test_every_checkpoint_damaged_is_a_clear_error_that_changes_nothing(
    finished, demo_data, tmp_path
):
    run_dir = copy_of(finished, tmp_path)
    for step in (2, 4, 6):
        truncate(step_dir(run_dir, step) / "rng.pt")
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    try:
        with pytest.raises(CheckpointError) as error:
            run_in_process(run_dir, jobs(demo_data), SAVES)
    finally:
        mm.destroy_parallel()
    message = str(error.value)
    assert all(str(step_dir(run_dir, s) / "rng.pt") in message for s in (2, 4, 6))
    assert "checkpoint.resume=never" in message and "new run_dir" in message
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before

    # an explicitly named damaged checkpoint is an error too, not a fallback
    try:
        with pytest.raises(CheckpointError, match=f"{step_dir(run_dir, 4) / 'rng.pt'} has"):
            run_in_process(
                run_dir, jobs(demo_data), [*SAVES, f"checkpoint.resume={step_dir(run_dir, 4)}"]
            )
    finally:
        mm.destroy_parallel()


@pytest.mark.parametrize("why", ["checkpoint.resume=never", "no checkpoint to resume"])
def test_starting_over_moves_the_earlier_run_aside(why, finished, demo_data, tmp_path, capsys):
    run_dir = copy_of(finished, tmp_path)
    if why == "no checkpoint to resume":  # killed before its first save
        shutil.rmtree(run_dir / "checkpoints")
    out = resume(run_dir, demo_data, capsys, [why] if why.startswith("checkpoint.") else [])
    assert f"holds an earlier run ({why}): starting at step 0" in out
    assert f"moved to {run_dir / 'previous' / '1'}" in out
    assert records(run_dir) == records(finished)  # one trajectory, not two appended
    assert records(run_dir / "previous" / "1") == records(finished)
    moved = sorted(p.name for p in (run_dir / "previous" / "1").iterdir())
    # The run was cut short by trainer.max_steps: its unfinished adapters were exported too.
    # Starting over on purpose also sets its serve/ folder (status, submissions) aside; one
    # that found no checkpoint keeps it to replay what was submitted.
    assert moved == (
        ["adapters", "checkpoints", "metrics.jsonl", "serve"]
        if why.startswith("checkpoint.")
        else ["adapters", "metrics.jsonl"]
    )
    earlier = folder.read_status(finished)["updated_at"]
    assert folder.read_status(run_dir)["updated_at"] > earlier  # written by the new run


def test_explicit_older_checkpoint_sets_the_newer_ones_aside(finished, demo_data, tmp_path, capsys):
    run_dir = copy_of(finished, tmp_path)
    older = step_dir(run_dir, 2)
    out = resume(run_dir, demo_data, capsys, [f"checkpoint.resume={older}"])
    assert f"resumed from {older} at step 2" in out
    assert records(run_dir) == records(finished)
    for step in (4, 6):  # the old ones kept, byte for byte; new ones written in their place
        aside = run_dir / "checkpoints" / "set_aside" / f"step_{step:08d}"
        assert (aside / "manifest.json").read_bytes() == (
            step_dir(finished, step) / "manifest.json"
        ).read_bytes()
        verify_manifest(step_dir(run_dir, step))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_stop_signal_saves_at_the_step_boundary_and_resumes_identically(
    signum, finished, demo_data, tmp_path, capsys
):
    from megatron_multilora.training.trainer import Trainer

    run_dir = tmp_path / "run"
    recipe = Trainer(
        compose_run(
            [
                *QUIET,
                f"run_dir={run_dir}",
                "lora.slots=2",
                f"adapters=[{','.join(jobs(demo_data))}]",
                *SAVES,
            ]
        )
    )
    step = recipe.train_one_step

    def signalled_during_step_3(active):
        if recipe.step == 2:
            os.kill(os.getpid(), signum)  # arrives mid-step; the step still completes
        return step(active)

    recipe.train_one_step = signalled_during_step_3
    handler = signal.getsignal(signum)
    try:
        with pytest.raises(RunStopped) as stop, stop_on_signals():
            recipe.setup()
            recipe.train()
    finally:
        mm.destroy_parallel()
    assert (stop.value.signum, stop.value.step, stop.value.checkpoint) == (
        signum,
        3,
        step_dir(run_dir, 3),
    )
    assert signal.getsignal(signum) is handler  # put back
    verify_manifest(step_dir(run_dir, 3))  # between the save interval's steps 2 and 4
    assert losses_by_adapter(run_dir)["rev"] == losses_by_adapter(finished)["rev"][:3]

    out = resume(run_dir, demo_data, capsys)
    assert f"resumed from {step_dir(run_dir, 3)} at step 3" in out
    assert records(run_dir) == records(finished)


def test_bf16_run_resumes_from_its_fp32_master_weights(demo_data, tmp_path, capsys):
    """bf16 adapters step fp32 masters; a checkpoint holds the masters, so a resumed bf16 run
    continues exactly (from the bf16 weights alone, the masters' rounding, it would not)."""
    bf16 = [*SAVES, "trainer.precision=bf16"]
    finished = tmp_path / "uninterrupted"
    run_in_process(finished, jobs(demo_data), bf16)
    run_dir = copy_of(finished, tmp_path)
    older = step_dir(run_dir, 2)
    out = resume(run_dir, demo_data, capsys, [*bf16[len(SAVES) :], f"checkpoint.resume={older}"])
    assert f"resumed from {older} at step 2" in out
    assert records(run_dir) == records(finished)


def test_a_full_disk_during_a_checkpoint_is_one_clear_error_and_resumes_exactly(
    finished, demo_data, tmp_path, capsys, monkeypatch
):
    """The write of step 4's checkpoint fails as on a full disk: the run ends with one message
    naming that checkpoint and the intact previous one; nothing half-written is left; a rerun
    resumes from step 2 and logs exactly the uninterrupted run's records."""
    import errno

    from megatron_multilora.training import checkpoints

    real = checkpoints.save_file

    def full_disk(tensors, filename, *args, **kwargs):
        if "step_00000004" in str(Path(filename).parent.name) or ".step_00000004" in filename:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(checkpoints, "save_file", full_disk)
    run_dir = tmp_path / "run"
    with pytest.raises(CheckpointError) as err:
        run_in_process(run_dir, jobs(demo_data), SAVES)
    mm.destroy_parallel()
    message = str(err.value)
    assert f"checkpoint {step_dir(run_dir, 4)} could not be written" in message
    assert "No space left on device" in message
    assert f"the previous checkpoint {step_dir(run_dir, 2)} is intact" in message
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest.json",
        "step_00000002",
    ]
    monkeypatch.setattr(checkpoints, "save_file", real)
    out = resume(run_dir, demo_data, capsys)
    assert f"resumed from {step_dir(run_dir, 2)} at step 2" in out
    assert records(run_dir) == records(finished)

"""More jobs than device slots (trainer.active_jobs): the jobs take turns by step, their
adapters paged between the device slots and host memory; each job trains as alone; a resume
from a checkpoint saved mid-rotation is exact; a checkpoint links, instead of writing again,
the files of jobs that did not step since the previous one."""

import os

import torch

from megatron_multilora.training.checkpoints import job_file
from tests.recipe.conftest import QUIET, job, losses_by_adapter, read_metrics, run_in_process
from tests.recipe.test_cli import TORCHRUN, finish, launch
from tests.recipe.test_training import REL, assert_same_curve

TASKS = ("reverse", "add", "sort", "uppercase")


def _jobs(demo_data, n: int, steps: int = 3) -> list[str]:
    return [
        job(
            f"j{i:02d}",
            demo_data,
            TASKS[i % len(TASKS)],
            steps,
            lr=(3e-3, 1e-3)[i % 2],
            global_batch_size=(2, 4)[i % 3 == 0],
            schedule=("constant", "cosine")[i % 2],
        )
        for i in range(n)
    ]


def test_forty_jobs_over_eight_device_slots_train_as_each_alone(demo_data, tmp_path):
    jobs = _jobs(demo_data, 40)
    paged, trainer = run_in_process(
        tmp_path / "paged", jobs, ["lora.slots=8", "trainer.active_jobs=40"]
    )
    stats = trainer.rt.table.stats
    # the scenario happened: all 40 started at once, 8 stepped per step, adapters moved
    assert trainer.step == 15  # 40 jobs x 3 steps / 8 slots
    assert stats.pages_out >= 40 and stats.pages_in >= 40 and stats.bytes_out > 0
    steps = [r["step"] for r in read_metrics(tmp_path / "paged" / "metrics.jsonl")]
    stepping = {}
    for record in read_metrics(tmp_path / "paged" / "metrics.jsonl"):
        if record["kind"] == "train":
            stepping[record["step"]] = len(record["adapters"])
    assert set(stepping.values()) == {8} and len(steps) >= 15
    assert all(j.status == "done" and j.steps_done == 3 for j in trainer.board.jobs)
    # against every job resident (40 slots, each stepping every step) and two alone
    resident, _ = run_in_process(tmp_path / "resident", jobs, ["lora.slots=40"])
    for name in paged:
        assert_same_curve(paged[name], resident[name], REL, f"{name} loss, paged vs resident")
    for i in (0, 37):
        alone, _ = run_in_process(tmp_path / f"alone{i}", [jobs[i]], ["lora.slots=1"])
        name = f"j{i:02d}"
        assert_same_curve(paged[name], alone[name], REL, f"{name} loss, paged vs alone")
    for name in ("j00", "j37"):  # the exports are the adapters trained
        assert (tmp_path / "paged" / "adapters" / name / "adapter.safetensors").is_file()


def test_a_paged_run_resumes_exactly_and_checkpoints_link_unchanged_jobs(demo_data, tmp_path):
    """Six jobs over two slots, saved every step: a job that did not step since the last
    checkpoint is the same file (a hard link); a run cut at step 5 and resumed from there
    logs the same bits as the uninterrupted one."""
    jobs = _jobs(demo_data, 6, steps=4)
    paging = ["lora.slots=2", "trainer.active_jobs=6", "checkpoint.save_interval=1"]
    whole, _ = run_in_process(tmp_path / "whole", jobs, [*paging, "checkpoint.keep_last=0"])
    folders = sorted((tmp_path / "whole" / "checkpoints").glob("step_*"))
    assert len(folders) == 12
    a, b = folders[5], folders[6]  # after steps 6 and 7
    linked = changed = 0
    for name in ("j00", "j01", "j02", "j03", "j04", "j05"):
        if (a / job_file(name)).exists() and (b / job_file(name)).exists():
            same = os.stat(a / job_file(name)).st_ino == os.stat(b / job_file(name)).st_ino
            linked, changed = linked + same, changed + (not same)
    assert (linked, changed) == (4, 2)  # two stepped between them, the others were linked

    run_in_process(tmp_path / "cut", jobs, [*paging, "trainer.max_steps=5"])
    state = torch.load(
        tmp_path / "cut" / "checkpoints" / "step_00000005" / "state.pt", weights_only=False
    )
    assert len(state["jobs"]) == 6  # every job training, four of them paged out
    resumed, trainer = run_in_process(tmp_path / "cut", jobs, paging)
    assert trainer.step == 12
    for name, losses in whole.items():
        assert resumed[name] == losses, name  # the same bits
    assert losses_by_adapter(tmp_path / "cut", "grad_norm") == losses_by_adapter(
        tmp_path / "whole", "grad_norm"
    )


def test_paging_under_tensor_and_sequence_parallelism_and_resume_across_layouts(
    demo_data, tmp_path
):
    """Six jobs over two slots under TP=2 with SP (two processes, each paging its shards)
    train the trajectories of the one-process run; cut at step 5 there, the run resumes in
    one process and ends as the one-process run does."""
    jobs = _jobs(demo_data, 6, steps=4)
    paging = ["lora.slots=2", "trainer.active_jobs=6", "checkpoint.save_interval=1"]
    one, _ = run_in_process(tmp_path / "tp1", jobs, paging)
    cmd = [
        TORCHRUN,
        "--standalone",
        "--nproc-per-node=2",
        "--local-ranks-filter=0",
        "recipes/multi_lora_finetune.py",
        f"run_dir={tmp_path / 'tp2'}",
        *(o for o in QUIET if not o.startswith("checkpoint.save_interval")),
        "parallel=tp2",
        f"adapters=[{','.join(jobs)}]",
        *paging,
        "trainer.max_steps=5",
    ]
    out = finish(launch(cmd, tmp_path / "tp2.log"), tmp_path / "tp2.log")
    assert "6 adapter jobs on 2 slots (6 at once, taking turns" in out
    cut = losses_by_adapter(tmp_path / "tp2")
    for name, losses in cut.items():
        assert len(losses) == 5 * 2 // 6 + (int(name[1:]) < 5 * 2 % 6)  # its turns so far
        assert_same_curve(losses, one[name][: len(losses)], 1e-6, f"{name} loss, TP=2 vs 1")
    resumed, trainer = run_in_process(tmp_path / "tp2", jobs, paging)
    assert trainer.step == 12
    for name, losses in one.items():
        assert_same_curve(resumed[name], losses, 1e-6, f"{name} loss, resumed at TP=1")

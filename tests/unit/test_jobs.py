"""Jobs and the board of slots they train in: slots, start steps, budgets, data order, their
checkpointed progress, ending and cancelling."""

import dataclasses
import types
from pathlib import Path

import pytest

import megatron_multilora as mm
from megatron_multilora.data.datasets import Example
from megatron_multilora.training.config import AdapterJob, TrainerSettings
from megatron_multilora.training.jobs.board import JobBoard
from megatron_multilora.training.jobs.exporter import JobExporter
from megatron_multilora.training.jobs.job import Job, planned_steps, planned_turns, total_steps
from megatron_multilora.training.jobs.states import ACTIVE, CANCELLED, DONE, QUEUED
from megatron_multilora.training.objectives.sft import SFT
from megatron_multilora.training.runtime import Runtime
from megatron_multilora.training.step.slot_step import SlotStep

CFG = mm.GPTModelConfig(
    num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, vocab_size=32
)


def specs():
    return [
        AdapterJob(name="a", dataset="-", max_steps=3, rank=4),
        AdapterJob(name="b", dataset="-", epochs=2, global_batch_size=4, rank=2),  # 10 -> 5
        AdapterJob(name="c", dataset="-", max_steps=2, start_step=4, rank=4),
    ]


def job(spec: AdapterJob, steps_per_job=None) -> Job:
    train = [Example((1, 2, 3), (False, True))] * 10
    return Job(spec, SFT(), train, [], [], total_steps(spec, len(train), steps_per_job))


def board(tmp_path: Path, steps_per_job=None, active_jobs=None) -> JobBoard:
    model = mm.apply_multi_lora(mm.build_gpt_model(CFG, calculate_per_token_loss=True), 2, 4, 1.0)
    settings = TrainerSettings(
        max_steps=None, steps_per_job=steps_per_job, max_bad_steps=2, active_jobs=active_jobs
    )
    lora = type("Lora", (), {"targets": ["linear_qkv"], "max_rank": 4})()
    said = []
    run = types.SimpleNamespace(
        lora=types.SimpleNamespace(slots=2), seed=1, trainer=types.SimpleNamespace(max_seq_len=64)
    )
    runtime = Runtime(run, CFG, None, None, [model], SlotStep([model], 2, 64, 1, 0))
    b = JobBoard(
        runtime, settings, JobExporter(tmp_path, model, CFG, lora, None, None), said.append
    )
    for s in specs():
        b.enqueue(job(s, steps_per_job))
    b.said = said
    return b


def test_admission_respects_slots_and_start_steps(tmp_path):
    b = board(tmp_path)
    assert [j.total_steps for j in b.jobs] == [3, 5, 2]
    assert [j.name for j in b.admit(0)] == ["a", "b"] and b.admit(0) == []
    assert b.said[0] == "step 0: job a starts on slot 0 (3 steps, rank 4, alpha 8, lr 0.001 cosine)"
    a = b.named("a")
    a.steps_done = 3
    assert b.retire(3) == [a] and a.status == DONE and a.slot is None and a.optimizer is None
    assert (tmp_path / "adapters" / "a" / "adapter_config.json").is_file()  # exported
    assert b.admit(3) == []  # c waits for its start step although a slot is free
    (c,) = b.admit(4)
    assert c.name == "c" and c.slot == 0 and c.status == ACTIVE and c.optimizer is not None
    assert planned_steps([job(s) for s in specs()], 2) == 6
    # Planned from step 4, c's start step has come: a, b, then c on a's slot at 7.
    assert planned_steps([job(s) for s in specs()], 2, now=4) == 5


def test_sample_order_is_reproducible_per_job_and_wraps_epochs():
    a = job(specs()[0])
    first = a.next_samples(6, seed=1) + a.next_samples(6, seed=1)
    assert sorted(first[:10]) == list(range(10)) and (a.data_epoch, a.data_pos) == (1, 2)
    again = job(specs()[0])
    assert again.next_samples(12, seed=1) == first
    assert job(specs()[1]).next_samples(6, seed=1) != first[:6]  # per job name

    restored = job(specs()[0])
    restored.restore(a.progress())
    assert restored.next_samples(3, 1) == a.next_samples(3, 1)


def test_progress_round_trips_and_must_name_the_same_jobs(tmp_path):
    b = board(tmp_path)
    b.admit(0)
    b.named("b").steps_done = 2
    saved = b.progress()
    fresh = board(tmp_path)
    fresh.restore(saved)
    assert [(j.status, j.slot, j.steps_done) for j in fresh.jobs] == [
        (ACTIVE, 0, 0),
        (ACTIVE, 1, 2),
        (QUEUED, None, 0),
    ]
    short = board(tmp_path)
    short.jobs = short.jobs[:2]
    with pytest.raises(ValueError, match="differ"):
        short.restore(saved)


def test_steps_per_job_replaces_every_jobs_budget(tmp_path):
    b = board(tmp_path, steps_per_job=4)
    assert [j.total_steps for j in b.jobs] == [4, 4, 4]  # max_steps and epochs alike
    assert planned_steps(b.jobs, 2) == 8  # c starts at step 4 on the slot a frees


def test_too_many_bad_steps_fail_a_job_and_cancel_ends_or_dequeues(tmp_path):
    b = board(tmp_path)
    b.admit(0)
    b.named("a").bad_steps = 2
    (a,) = b.retire(1)
    assert a.status == "failed" and not (tmp_path / "adapters" / "a").exists()
    b.cancel("b", 1)
    b.cancel("c", 1)
    assert [(j.status, j.reason) for j in b.jobs[1:]] == [
        (CANCELLED, "cancelled after 0 steps; exported as it stood"),
        (CANCELLED, "cancelled before it started"),
    ]
    assert [j.name for j in b.exported()] == ["b"] and b.finished()


def test_an_ending_job_logs_its_last_window_before_its_end_line_and_none_after(tmp_path):
    from megatron_multilora.training.report.metrics import read_metrics
    from megatron_multilora.training.report.run_report import RunReport

    b = board(tmp_path)
    run = types.SimpleNamespace(
        run_dir=str(tmp_path / "run"),
        logging=types.SimpleNamespace(wandb_mode="disabled", wandb_project="p"),
    )
    report = RunReport(run, True, {})
    printed = []
    b.say = printed.append
    b.jobs = b.jobs[:2]  # a (3 steps) and b (5 steps) on the 2 slots
    b.on_end = lambda job, step: report.job_ended(step, job.name, b)
    b.admit(0)
    report.begin(0, b.planned(0))
    report.progress.write = printed.append
    printed.clear()
    assert report.progress.total == 5
    stats = {"loss": 1.0, "lr": 1e-3, "grad_norm": 0.5, "tokens": 8, "loss_tokens": 4}
    for step in (1, 2, 3):
        report.stepped(step, {"a": stats, "b": stats})
        b.named("a").steps_done = b.named("b").steps_done = step
    b.retire(3)  # a's budget is spent: the window closes (one record), then a's end line
    assert printed[0].startswith("step    3 | a loss  1.000")
    assert printed[1].startswith("step    3 | b loss  1.000")
    assert printed[2].startswith("step 3: job a done") and len(printed) == 3
    printed.clear()
    report.stepped(4, {"b": stats})
    b.named("b").steps_done = 4
    b.cancel("b", 4)  # one step short: the total follows the jobs left
    assert printed[0].startswith("step    4 | b loss  1.000")
    assert printed[1].startswith("step 4: job b cancelled") and len(printed) == 2
    assert report.progress.total == 4
    report.log_train(4, b)  # the scheduled log at the same step: nothing left, no record
    assert len(printed) == 2
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert steps == [3, 4]


def _random_board(rng, most: int, turns: bool) -> list[Job]:
    """Up to ``most`` jobs of random budgets and start steps, queued, training (some steps
    done; ``turns``: some turns taken) or done."""
    jobs = []
    for i in range(rng.randint(0, most)):
        spec = AdapterJob(
            name=f"j{i}",
            dataset="-",
            max_steps=rng.randint(1, 9),
            start_step=rng.choice([0, 0, rng.randint(0, 20)]),
        )
        j = job(spec)
        j.status = rng.choice([QUEUED, QUEUED, ACTIVE, DONE])
        if j.status == ACTIVE:
            j.steps_done = rng.randint(0, j.total_steps - 1)
            if turns:
                j.turn = rng.choice([-1, rng.randint(0, 99)])
        jobs.append(j)
    return jobs


def _planned_step_by_step(jobs, slots, now):
    """The plan played out one trainer step at a time (the board's admission rule)."""
    left = {
        i: j.total_steps - j.steps_done for i, j in enumerate(jobs) if j.status in (QUEUED, ACTIVE)
    }
    running = {i for i, j in enumerate(jobs) if j.status == ACTIVE}
    step = now
    while left:
        for i in sorted(left):
            if len(running) < slots and i not in running and jobs[i].spec.start_step <= step:
                running.add(i)
        for i in list(running):
            left[i] -= 1
            if left[i] <= 0:
                running.discard(i)
                del left[i]
        step += 1
    return step - now


def test_the_plan_equals_the_queue_played_out_step_by_step_and_scales():
    """The progress total is replanned at every job's end: by slot-free times, it equals the
    step-by-step play of the queue on random boards, and plans 4,096 jobs at once."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        jobs = _random_board(rng, 12, turns=False)
        slots = rng.randint(1, 4)
        if sum(j.status == ACTIVE for j in jobs) > slots:
            continue
        now = rng.randint(0, 10)
        assert planned_steps(jobs, slots, now) == _planned_step_by_step(jobs, slots, now)
    many = [job(AdapterJob(name=f"j{i}", dataset="-", max_steps=100)) for i in range(4096)]
    assert planned_steps(many, 1024) == 400


def _turns_step_by_step(jobs, slots, at_once, now):
    """The plan with turns played out one trainer step at a time, by the board's rules:
    start queued jobs while fewer than ``at_once`` train; the ``slots`` that stepped least
    recently (by their numbered turns; never first, in queue order) step."""
    left = {
        i: j.total_steps - j.steps_done for i, j in enumerate(jobs) if j.status in (QUEUED, ACTIVE)
    }
    last = {i: j.turn for i, j in enumerate(jobs)}
    turns = 1 + max(last.values(), default=-1)
    running = {i for i, j in enumerate(jobs) if j.status == ACTIVE}
    step = now
    while left:
        for i in sorted(left):
            if len(running) < at_once and i not in running and jobs[i].spec.start_step <= step:
                running.add(i)
                last[i] = -1
        for i in sorted(running, key=lambda i: (last[i], i))[:slots]:
            last[i], turns = turns, turns + 1
            left[i] -= 1
            if left[i] <= 0:
                running.discard(i)
                del left[i]
        step += 1
    return step - now


def test_the_plan_with_turns_equals_the_turns_played_out_step_by_step():
    import random

    rng = random.Random(1)
    for _ in range(300):
        jobs = _random_board(rng, 14, turns=True)
        slots = rng.randint(1, 4)
        at_once = rng.randint(slots, 8)
        if sum(j.status == ACTIVE for j in jobs) > at_once:
            continue
        now = rng.randint(10, 12)
        want = _turns_step_by_step(jobs, slots, at_once, now)
        assert planned_turns(jobs, slots, at_once, now) == want
        if at_once == slots and all(j.turn < 0 for j in jobs):
            assert planned_steps(jobs, slots, now) == want  # all of them step every step
    many = [job(AdapterJob(name=f"j{i}", dataset="-", max_steps=10)) for i in range(4096)]
    assert planned_turns(many, 64, 4096) == 640


def test_jobs_beyond_the_device_slots_take_turns_paged(tmp_path):
    """Three jobs, two device slots, trainer.active_jobs=3: all start, two step per turn
    (the least recently stepped), the third waits paged out in host memory."""
    b = board(tmp_path, active_jobs=3)
    for j in b.jobs:
        j.spec = dataclasses.replace(j.spec, start_step=0)
    started = b.admit(0)
    assert [j.name for j in started] == ["a", "b", "c"]
    assert sum(j.slot is None for j in b.jobs) == 1 and len(b.table.pages) == 1
    turns = []
    for _ in range(4):
        turn = b.turn(b.active())
        assert all(j.slot is not None for j in turn)
        turns.append(sorted(j.name for j in turn))
    assert turns == [["a", "b"], ["a", "c"], ["b", "c"], ["a", "b"]]  # a round robin
    assert b.table.stats.pages_in >= 2 and b.table.stats.bytes_out > 0
    paged = next(j for j in b.jobs if j.slot is None)
    b.cancel(paged.name, 3)  # exported from a slot it is paged into, then dropped
    assert paged.name not in b.table and (tmp_path / "adapters" / paged.name).is_dir()

"""The job queue: slots, start steps, budgets, data order and its state."""

import pytest

from megatron_multilora.training.config import AdapterJob
from megatron_multilora.training.job_states import ACTIVE, DONE, QUEUED
from megatron_multilora.training.jobs import JobQueue, planned_steps


def jobs():
    return [AdapterJob(name="a", dataset="-", max_steps=3),
            AdapterJob(name="b", dataset="-", epochs=2, global_batch_size=4),  # 10 samples -> 5
            AdapterJob(name="c", dataset="-", max_steps=2, start_step=4)]


def test_admission_respects_slots_and_start_steps():
    q = JobQueue(jobs(), [10, 10, 10], slots=2)
    assert [s.total_steps for s in q.states] == [3, 5, 2]
    assert [s.name for s in q.admit(0)] == ["a", "b"] and q.admit(0) == []
    q.release(q.states[0], DONE, "budget")
    assert q.admit(3) == []  # c waits for its start step although a slot is free
    (c,) = q.admit(4)
    assert c.name == "c" and c.slot == 0 and c.status == ACTIVE
    assert planned_steps(jobs(), JobQueue(jobs(), [10] * 3, 2).states, 2) == 6


def test_sample_order_is_reproducible_per_job_and_wraps_epochs():
    q = JobQueue(jobs(), [10, 10, 10], slots=2)
    a = q.states[0]
    first = q.next_samples(a, 6, 10, seed=1) + q.next_samples(a, 6, 10, seed=1)
    assert sorted(first[:10]) == list(range(10)) and (a.data_epoch, a.data_pos) == (1, 2)
    again = JobQueue(jobs(), [10, 10, 10], slots=2)
    assert again.next_samples(again.states[0], 12, 10, seed=1) == first
    assert again.next_samples(again.states[1], 6, 10, seed=1) != first[:6]  # per job name

    restored = JobQueue(jobs(), [10, 10, 10], slots=2)
    restored.load_state_dict(q.state_dict())
    assert restored.next_samples(restored.states[0], 3, 10, 1) == q.next_samples(a, 3, 10, 1)
    assert restored.states[2].status == QUEUED
    with pytest.raises(ValueError, match="differ"):
        JobQueue(jobs()[:2], [10, 10], 2).load_state_dict(q.state_dict())


def test_steps_per_job_replaces_every_jobs_budget():
    q = JobQueue(jobs(), [10, 10, 10], slots=2, steps_per_job=4)
    assert [s.total_steps for s in q.states] == [4, 4, 4]  # max_steps and epochs alike
    assert planned_steps(jobs(), q.states, 2) == 8  # c starts at step 4 on the slot a frees

"""Adapter jobs over time: the queue, slot assignment, budgets and each job's data position.

Every rank keeps an identical copy (all decisions derive from the config, the step and
values already agreed across ranks), so no coordination is needed beyond the training step.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Optional

import torch

from megatron_multilora.training.config import AdapterJob
from megatron_multilora.training.job_states import ACTIVE, ENDED, QUEUED


@dataclasses.dataclass
class JobState:
    """Where one job stands. ``data_epoch``/``data_pos`` index its shuffled sample order."""

    index: int
    name: str
    total_steps: int
    status: str = QUEUED
    slot: Optional[int] = None
    steps_done: int = 0
    data_epoch: int = 0
    data_pos: int = 0
    bad_steps: int = 0
    reason: str = ""


def total_steps(job: AdapterJob, dataset_size: int, steps_per_job: Optional[int] = None) -> int:
    """The job's step budget: ``steps_per_job`` (the trainer-wide override) when given, else
    its ``max_steps``, or ``epochs`` over its dataset."""
    if steps_per_job is not None:
        return steps_per_job
    if job.max_steps is not None:
        return job.max_steps
    return max(1, math.ceil(job.epochs * dataset_size / job.global_batch_size))


def planned_steps(jobs: list[AdapterJob], states: list[JobState], slots: int) -> int:
    """Trainer steps until every job finishes if none fails: the queue, simulated."""
    remaining = {s.index: s.total_steps - s.steps_done for s in states if s.status in (QUEUED, ACTIVE)}
    running = {s.index for s in states if s.status == ACTIVE}
    step = 0
    while remaining:
        for index in sorted(remaining):
            if len(running) < slots and index not in running and jobs[index].start_step <= step:
                running.add(index)
        for index in list(running):
            remaining[index] -= 1
            if remaining[index] <= 0:
                running.discard(index)
                del remaining[index]
        step += 1
    return step


class JobQueue:
    """Jobs waiting for, holding and leaving adapter slots."""

    def __init__(self, jobs: list[AdapterJob], dataset_sizes: list[int], slots: int,
                 steps_per_job: Optional[int] = None) -> None:
        self.jobs = jobs
        self.slots = slots
        self.steps_per_job = steps_per_job
        self.states = [JobState(i, job.name, total_steps(job, n, steps_per_job))
                       for i, (job, n) in enumerate(zip(jobs, dataset_sizes))]

    def add(self, job: AdapterJob, dataset_size: int) -> JobState:
        """Queue one more job (``jobs`` must already hold it, last); it takes a slot from its
        start step on, after the jobs before it."""
        if self.jobs[-1] is not job or len(self.jobs) != len(self.states) + 1:
            raise ValueError(f"append job {job.name} to the queue's jobs before adding it")
        state = JobState(len(self.states), job.name, total_steps(job, dataset_size, self.steps_per_job))
        self.states.append(state)
        return state

    def active(self) -> list[JobState]:
        return sorted((s for s in self.states if s.status == ACTIVE), key=lambda s: s.slot)

    def admit(self, step: int) -> list[JobState]:
        """Give free slots to queued jobs whose start step has come, in config order."""
        used = {s.slot for s in self.active()}
        free = [k for k in range(self.slots) if k not in used]
        admitted = []
        for state in self.states:
            if not free:
                break
            if state.status == QUEUED and self.jobs[state.index].start_step <= step:
                state.status, state.slot = ACTIVE, free.pop(0)
                admitted.append(state)
        return admitted

    def release(self, state: JobState, status: str, reason: str) -> Optional[int]:
        """End a job (done, failed or cancelled); returns the slot it frees, if it had one."""
        slot = state.slot
        state.status, state.reason, state.slot = status, reason, None
        return slot

    def finished(self) -> bool:
        return all(s.status in ENDED for s in self.states)

    def next_samples(self, state: JobState, n: int, dataset_size: int, seed: int) -> list[int]:
        """The job's next ``n`` sample indices: a fresh shuffle every epoch, seeded by
        (seed, job name, epoch), so the order is reproducible, survives resume and does not
        depend on which other jobs run."""
        out = []
        while len(out) < n:
            key = zlib.crc32(f"{seed}:{state.name}:{state.data_epoch}".encode())
            order = torch.randperm(dataset_size, generator=torch.Generator().manual_seed(key)).tolist()
            take = order[state.data_pos:state.data_pos + n - len(out)]
            out += take
            state.data_pos += len(take)
            if state.data_pos >= dataset_size:
                state.data_epoch, state.data_pos = state.data_epoch + 1, 0
        return out

    def state_dict(self) -> list[dict]:
        return [dataclasses.asdict(s) for s in self.states]

    def load_state_dict(self, states: list[dict]) -> None:
        if [s["name"] for s in states] != [s.name for s in self.states]:
            raise ValueError("the checkpoint's adapter jobs differ from the configured ones: "
                             f"{[s['name'] for s in states]} vs {[s.name for s in self.states]}")
        self.states = [JobState(**s) for s in states]

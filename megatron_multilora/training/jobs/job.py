"""One adapter job from its config entry to its end: the :class:`Job` record.

Every rank keeps an identical copy of every job (all decisions derive from the config, the
step and values already agreed across ranks), so no coordination is needed beyond the
training step.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import zlib
from typing import Any

import torch

from megatron_multilora.training.config import AdapterJob
from megatron_multilora.training.jobs.states import ACTIVE, QUEUED
from megatron_multilora.training.objectives.objective import Objective
from megatron_multilora.training.objectives.registry import JOB_OBJECTIVES
from megatron_multilora.training.step.slot_optimizer import SlotOptimizer

# What a checkpoint keeps of a job's progress (the rest comes from its config entry).
PROGRESS = (
    "total_steps",
    "status",
    "slot",
    "steps_done",
    "data_epoch",
    "data_pos",
    "bad_steps",
    "reason",
    "turn",
)
# Progress keys an earlier version's checkpoints lack, with the value that means the same.
PROGRESS_DEFAULTS = {"turn": -1}


def total_steps(job: AdapterJob, dataset_size: int, steps_per_job: int | None = None) -> int:
    """The job's step budget: ``steps_per_job`` (the trainer-wide override) when given, else
    its ``max_steps``, or ``epochs`` over its dataset (a GRPO job steps ``inner_steps``
    times on each batch of prompts)."""
    if steps_per_job is not None:
        return steps_per_job
    if job.max_steps is not None:
        return job.max_steps
    per_batch = JOB_OBJECTIVES[job.objective].steps_per_batch(job)
    return max(1, math.ceil(job.epochs * dataset_size / job.global_batch_size) * per_batch)


@dataclasses.dataclass(eq=False)
class Job:
    """A job's config entry (``spec``, never changed), its objective, its data (what the
    objective loads: examples, pairs or prompt records), where it stands and, while it
    trains, its slot and optimizer. ``data_epoch``/``data_pos`` index its shuffled sample
    order; ``metrics`` holds its latest logged values (for ``mmlora status``); ``state`` is
    what its objective keeps between steps (``Objective.new_state``: DPO's references
    added, GRPO's reward and rollout)."""

    spec: AdapterJob
    objective: Objective
    train: list
    eval: list
    eval_records: list[dict]
    total_steps: int
    source: str = "config"  # or "submitted" (with mmlora submit)
    status: str = QUEUED
    slot: int | None = None
    steps_done: int = 0
    data_epoch: int = 0
    data_pos: int = 0
    bad_steps: int = 0
    reason: str = ""
    turn: int = -1  # when it last stepped, in the run's count of turns (-1: never)
    optimizer: SlotOptimizer | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    state: Any = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def finished_budget(self) -> bool:
        return self.steps_done >= self.total_steps

    def next_samples(self, n: int, seed: int) -> list[int]:
        """The job's next ``n`` sample indices: a fresh shuffle every epoch, seeded by (seed,
        job name, epoch), so the order is reproducible, survives resume and does not depend
        on which other jobs run."""
        out, size = [], len(self.train)
        while len(out) < n:
            key = zlib.crc32(f"{seed}:{self.name}:{self.data_epoch}".encode())
            order = torch.randperm(size, generator=torch.Generator().manual_seed(key)).tolist()
            take = order[self.data_pos : self.data_pos + n - len(out)]
            out += take
            self.data_pos += len(take)
            if self.data_pos >= size:
                self.data_epoch, self.data_pos = self.data_epoch + 1, 0
        return out

    def progress(self) -> dict[str, Any]:
        return {
            "name": self.name,
            **{key: getattr(self, key) for key in PROGRESS},
            **self.objective.state_to_plain(self.state),
        }

    def restore(self, progress: dict[str, Any]) -> None:
        for key in PROGRESS:
            setattr(self, key, progress.get(key, PROGRESS_DEFAULTS.get(key)))
        self.state = self.objective.state_from_plain(self.state, progress)


def planned_steps(jobs: list[Job], slots: int, now: int = 0) -> int:
    """Trainer steps from step ``now`` until every job finishes if none fails: the queue,
    played out by the times slots free up (a job's ``start_step`` is a trainer step, as
    ``now`` is). A slot goes to the first queued job whose start step has come; a job of
    ``r`` steps left started at ``t`` frees its slot for step ``t + r``. O(N log N) for N
    jobs that need no wait for their start step: the run replans at every job's end."""
    left = {id(j): max(1, j.total_steps - j.steps_done) for j in jobs}
    ends = [now + left[id(j)] for j in jobs if j.status == ACTIVE]
    last = max(ends, default=now)
    free = [now] * max(0, slots - len(ends)) + ends  # when each slot is next free
    heapq.heapify(free)
    queue = [j for j in jobs if j.status == QUEUED]
    while queue and free:
        t = heapq.heappop(free)
        k = next((k for k, j in enumerate(queue) if j.spec.start_step <= t), None)
        if k is None:  # none may start yet: the slot waits for the earliest start step
            heapq.heappush(free, min(j.spec.start_step for j in queue))
            continue
        end = t + left[id(queue.pop(k))]
        last = max(last, end)
        heapq.heappush(free, end)
    return last - now


def planned_turns(jobs: list[Job], slots: int, at_once: int, now: int = 0) -> int:
    """:func:`planned_steps` when up to ``at_once`` jobs (more than ``slots``) train at once,
    taking turns: at each step the ``slots`` training jobs that stepped least recently step
    (in their order of turns, :attr:`Job.turn`, never-stepped ones first in the order of
    ``jobs``, the queue's), and queued jobs start while fewer than ``at_once`` train. Played
    out turn by turn: O(every job's steps left)."""
    left = {id(j): max(1, j.total_steps - j.steps_done) for j in jobs}
    active = [j for j in jobs if j.status == ACTIVE]
    fresh = [(i, j) for i, j in enumerate(jobs) if j.status == ACTIVE and j.turn < 0]  # a heap
    rotation = collections.deque(sorted((j for j in active if j.turn >= 0), key=lambda j: j.turn))
    queue = [j for j in jobs if j.status == QUEUED]
    position = {id(j): i for i, j in enumerate(jobs)}
    t = now
    while fresh or rotation or queue:
        room = at_once - len(fresh) - len(rotation)
        if room > 0 and queue:
            started = [j for j in queue if j.spec.start_step <= t][:room]
            for j in started:
                heapq.heappush(fresh, (position[id(j)], j))
            taken = {id(j) for j in started}
            queue = [j for j in queue if id(j) not in taken]
        if not fresh and not rotation:
            t = min(j.spec.start_step for j in queue)
            continue
        turn = []
        while len(turn) < slots and (fresh or rotation):
            turn.append(heapq.heappop(fresh)[1] if fresh else rotation.popleft())
        t += 1
        for j in turn:
            left[id(j)] -= 1
        rotation.extend(j for j in turn if left[id(j)] > 0)
    return t - now

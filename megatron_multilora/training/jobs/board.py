"""The run's adapter jobs and the slots they train in.

A job waits in the queue until its start step and a free place (one of ``lora.slots``, or of
``trainer.active_jobs`` when more jobs than device slots train at once: they take turns by
step, the least recently stepped first, paged in and out by the runtime's
:class:`~..step.adapter_table.AdapterTable`); it starts from its
``init_from`` folder (an adapter or a PEFT folder) or fresh weights, with its own optimizer;
each step takes the next global batch of every training job; a job that reaches its budget is
exported and its slot (weights, optimizer, schedule, gradients) handed on; one whose loss or
gradients stay non-finite ``trainer.max_bad_steps`` steps in a row is stopped; a cancelled one
is exported as it stands.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from megatron_multilora.data.datasets import examples_of
from megatron_multilora.training.config import AdapterJob, TrainerSettings, job_alpha
from megatron_multilora.training.jobs.exporter import JobExporter
from megatron_multilora.training.jobs.job import Job, planned_steps, planned_turns, total_steps
from megatron_multilora.training.jobs.states import ACTIVE, CANCELLED, DONE, ENDED, FAILED, QUEUED
from megatron_multilora.training.objectives.registry import objective_of
from megatron_multilora.training.runtime import Runtime
from megatron_multilora.training.step.slot_step import SlotWork, StepResult


class JobBoard:
    """Every job of the run (config jobs first, then submitted ones) and the slots of the
    runtime's model they train in. ``say`` prints a line on the main process; ``on_end``
    hears of a training job that ends (its status set, before its end line is said)."""

    def __init__(
        self,
        runtime: Runtime,
        settings: TrainerSettings,
        exporter: JobExporter,
        say: Callable[[str], None],
        on_end: Callable[[Job, int], None] = lambda job, step: None,
    ) -> None:
        self.rt, self.settings, self.exporter, self.say = runtime, settings, exporter, say
        self.on_end = on_end
        self.n_slots, self.seed = runtime.run.lora.slots, runtime.run.seed
        self.max_active = max(settings.active_jobs or 0, self.n_slots)
        self.table = runtime.table  # by job name
        self.table.on_move = self._moved
        self.jobs: list[Job] = []
        self._by_name: dict[str, Job] = {}
        self._position: dict[str, int] = {}  # a job's place in the queue (ties in turns)
        self.tools = runtime.tools(self._fail)
        self._step = 0
        self._turns = 0  # turns taken so far, every job's (the next one's number)

    def add(self, spec: AdapterJob, source: str = "config") -> Job:
        """Queue a job (from its ``start_step`` on, after the jobs before it), its data loaded
        by its objective."""
        tr = self.settings
        objective = objective_of(spec)
        data = objective.load(spec, self.rt.tokenizer, tr.max_seq_len, tr.eval_samples)
        job = Job(
            spec,
            objective,
            data.train,
            data.eval,
            data.eval_records,
            total_steps(spec, len(data.train), tr.steps_per_job),
            source=source,
            state=objective.new_state(spec),
        )
        return self.enqueue(job)

    def enqueue(self, job: Job) -> Job:
        """Queue a built job (after the jobs before it)."""
        self._position[job.name] = len(self.jobs)
        self.jobs.append(job)
        self._by_name[job.name] = job
        return job

    def named(self, name: str) -> Job:
        return self._by_name[name]

    def active(self) -> list[Job]:
        """The training jobs: those in a device slot by slot, then the paged-out ones."""
        return sorted(
            (job for job in self.jobs if job.status == ACTIVE),
            key=lambda j: (j.slot is None, j.slot or 0, self._position[j.name]),
        )

    def turn(self, jobs: Sequence[Job]) -> list[Job]:
        """The training jobs that step now: all of them when they fit the device slots, else
        the ``lora.slots`` that stepped least recently (never-stepped ones first, in queue
        order), paged in: a round robin."""
        jobs = sorted(jobs, key=lambda j: (j.turn, self._position[j.name]))[: self.n_slots]
        self.place(jobs)
        for job in jobs:
            job.turn, self._turns = self._turns, self._turns + 1
        return sorted(jobs, key=lambda j: j.slot)

    def place(self, jobs: Sequence[Job]) -> None:
        """``jobs`` (at most ``lora.slots``) in device slots, paging others out."""
        self.table.place([job.name for job in jobs])

    def in_turns(self, jobs: Sequence[Job]) -> Iterator[list[Job]]:
        """``jobs`` in groups that fit the device slots, each group placed when it comes."""
        resident = [job for job in jobs if job.slot is not None]
        ordered = resident + [job for job in jobs if job.slot is None]
        for start in range(0, len(ordered), self.n_slots):
            group = ordered[start : start + self.n_slots]
            self.place(group)
            yield group

    def _moved(self, name: str, slot: int | None) -> None:
        self._by_name[name].slot = slot

    def finished(self) -> bool:
        return all(job.status in ENDED for job in self.jobs)

    def planned(self, step: int) -> int:
        """The step at which every job will have finished if none fails (the progress
        bar's total), capped by ``trainer.max_steps``."""
        if self.max_active > self.n_slots:
            budget = step + planned_turns(self.jobs, self.n_slots, self.max_active, step)
        else:
            budget = step + planned_steps(self.jobs, self.n_slots, step)
        return min(budget, self.settings.max_steps or budget)

    def admit(self, step: int) -> list[Job]:
        """Start queued jobs whose start step has come, in queue order, while fewer than
        ``lora.slots`` (or ``trainer.active_jobs``) train; each starts in a device slot."""
        room = self.max_active - sum(job.status == ACTIVE for job in self.jobs)
        started = []
        for job in self.jobs:
            if room > 0 and job.status == QUEUED and job.spec.start_step <= step:
                job.status, job.turn, room = ACTIVE, -1, room - 1
                self.place([job])
                job.optimizer = self.rt.start_slot(job.slot, job.spec, job.total_steps)
                self.table.bind(job.name, job.optimizer)
                spec = job.spec
                self.say(
                    f"step {step}: job {job.name} starts on slot {job.slot} "
                    f"({job.total_steps} steps, rank {spec.rank}, alpha {job_alpha(spec):g}, "
                    f"lr {spec.lr:g} {spec.schedule})"
                )
                started.append(job)
        return started

    def global_batch(
        self, step: int, jobs: Sequence[Job]
    ) -> tuple[dict[int, SlotWork], dict[int, tuple[int, int]], list[int]]:
        """What each objective needs first (DPO's references, GRPO's samples: a job whose
        reward fails ends here, the others go on), then each training job's work for the
        step (its next global batch, objective and optimizer) by slot, each slot's (tokens,
        loss tokens), and the packing order: by rank, so a micro-batch holds jobs of similar
        rank and low-rank jobs do not pay for a high-rank one's computed rank (then queue
        order)."""
        self._step = step
        for kind in {type(job.objective): None for job in jobs}:
            kind.prepare([job for job in jobs if type(job.objective) is kind], self.tools)
        work, tokens = {}, {}
        for job in (job for job in jobs if job.status == ACTIVE):
            items = job.objective.batch(job, self.seed)
            work[job.slot] = SlotWork(items, job.objective, job.optimizer)
            flat = [e for item in items for e in examples_of(item)]
            tokens[job.slot] = (
                sum(len(e.tokens) for e in flat),
                sum(sum(e.loss_mask) for e in flat),
            )
        # Ties in queue order, not slot order: which slot a job is in never changes its step.
        key = {job.slot: (job.spec.rank, self._position[job.name]) for job in jobs}
        order = sorted(range(self.n_slots), key=lambda slot: key.get(slot, (0, -1)))
        return work, tokens, order

    def _fail(self, job: Job, reason: str) -> None:
        self.end(job, FAILED, reason, self._step)

    def record(
        self,
        step: int,
        jobs: Sequence[Job],
        result: StepResult,
        tokens: dict[int, int],
        lrs: dict[int, float],
    ) -> dict[str, dict[str, float]]:
        """Count the step for each of ``jobs`` (a skipped one counts a bad step instead);
        returns the metrics of those that stepped, by name (``lrs``: what the step used)."""
        stats = {}
        for job in jobs:
            if job.slot in result.skipped:
                job.bad_steps += 1
                self.say(
                    f"step {step}: job {job.name} has non-finite loss/gradients; step "
                    f"skipped ({job.bad_steps}/{self.settings.max_bad_steps})"
                )
                continue
            job.bad_steps = 0
            job.steps_done += 1
            stats[job.name] = {
                "loss": float(result.losses[job.slot]),
                "lr": lrs[job.slot],
                "grad_norm": result.grad_norms[job.slot],
                "tokens": tokens[job.slot][0],
                "loss_tokens": tokens[job.slot][1],
                **{
                    name: float(value)
                    for name, value in zip(job.objective.metrics, result.metrics[job.slot])
                },
                **job.objective.step_metrics(job.state),
            }
        return stats

    def retire(self, step: int) -> list[Job]:
        """End the training jobs that failed too often or reached their budget."""
        ended = []
        for job in self.active():
            if job.bad_steps >= self.settings.max_bad_steps:
                self.end(job, FAILED, f"{job.bad_steps} non-finite steps in a row", step)
            elif job.finished_budget:
                self.end(job, DONE, f"{job.steps_done} steps", step)
            else:
                continue
            ended.append(job)
        return ended

    def end(self, job: Job, status: str, reason: str, step: int) -> None:
        """A training job ends: exported (unless it failed), its slot freed for the next."""
        if status in (DONE, CANCELLED):
            self.place([job])
            self.exporter.export(job, cancelled=status == CANCELLED)
        slot = self.table.forget(job.name)
        job.status, job.reason, job.slot = status, reason, None
        job.optimizer = None
        if slot is not None:
            self.rt.free_slot(slot)  # weights, rank, alpha, gradients back to a fresh slot
        self.on_end(job, step)
        where = f"slot {slot} is free" if slot is not None else "its page is dropped"
        self.say(f"step {step}: job {job.name} {status} ({reason}); {where}")

    def cancel(self, name: str, step: int) -> None:
        job = self.named(name)
        if job.status == ACTIVE:
            self.end(
                job,
                CANCELLED,
                f"cancelled after {job.steps_done} steps; exported as it stood",
                step,
            )
        elif job.status == QUEUED:
            job.status, job.reason = CANCELLED, "cancelled before it started"
            self.say(f"step {step}: job {name} cancelled before it started")

    def exported(self) -> list[Job]:
        """Done jobs, jobs cancelled while training, and jobs trainer.max_steps cut short
        (exported at the end of training)."""
        return [
            job
            for job in self.jobs
            if job.status in (DONE, ACTIVE)
            or (job.status == CANCELLED and self.exporter.folder(job).is_dir())
        ]

    def progress(self) -> list[dict]:
        return [job.progress() for job in self.jobs]

    def restore(self, progress: list[dict]) -> None:
        """The jobs' progress from a checkpoint (which lists the same jobs)."""
        if [p["name"] for p in progress] != [job.name for job in self.jobs]:
            raise ValueError(
                "the checkpoint's adapter jobs differ from the configured ones: "
                f"{[p['name'] for p in progress]} vs {[j.name for j in self.jobs]}"
            )
        for job, saved in zip(self.jobs, progress):
            job.restore(saved)
        self._turns = 1 + max((job.turn for job in self.jobs), default=-1)

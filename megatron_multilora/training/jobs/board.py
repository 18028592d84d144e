"""The run's adapter jobs and the slots they train in.

A job waits in the queue until its start step and a free slot; it starts from its
``init_from`` folder (an adapter or a PEFT folder) or fresh weights, with its own optimizer;
each step takes the next global batch of every training job; a job that reaches its budget is
exported and its slot (weights, optimizer, schedule, gradients) handed on; one whose loss or
gradients stay non-finite ``trainer.max_bad_steps`` steps in a row is stopped; a cancelled one
is exported as it stands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megatron_multilora.data.datasets import examples_of
from megatron_multilora.training.config import AdapterJob, TrainerSettings, job_alpha
from megatron_multilora.training.jobs.exporter import JobExporter
from megatron_multilora.training.jobs.job import Job, planned_steps, total_steps
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
        self.jobs: list[Job] = []
        self.tools = runtime.tools(self._fail)
        self._step = 0

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
        self.jobs.append(job)
        return job

    def named(self, name: str) -> Job:
        return next(job for job in self.jobs if job.name == name)

    def active(self) -> list[Job]:
        return sorted((job for job in self.jobs if job.status == ACTIVE), key=lambda j: j.slot)

    def finished(self) -> bool:
        return all(job.status in ENDED for job in self.jobs)

    def planned(self, step: int) -> int:
        """The step at which every job will have finished if none fails (the progress
        bar's total), capped by ``trainer.max_steps``."""
        budget = step + planned_steps(self.jobs, self.n_slots, step)
        return min(budget, self.settings.max_steps or budget)

    def admit(self, step: int) -> list[Job]:
        """Give free slots to queued jobs whose start step has come, in queue order."""
        used = {job.slot for job in self.active()}
        free = [k for k in range(self.n_slots) if k not in used]
        started = []
        for job in self.jobs:
            if free and job.status == QUEUED and job.spec.start_step <= step:
                job.status, job.slot = ACTIVE, free.pop(0)
                job.optimizer = self.rt.start_slot(job.slot, job.spec, job.total_steps)
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
        rank and low-rank jobs do not pay for a high-rank one's computed rank."""
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
        rank = {job.slot: job.spec.rank for job in jobs}
        order = sorted(range(self.n_slots), key=lambda slot: rank.get(slot, 0))
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
            self.exporter.export(job, cancelled=status == CANCELLED)
        slot = job.slot
        job.status, job.reason, job.slot = status, reason, None
        job.optimizer = None
        self.rt.free_slot(slot)  # weights, rank, alpha, gradients back to a fresh slot
        self.on_end(job, step)
        self.say(f"step {step}: job {job.name} {status} ({reason}); slot {slot} is free")

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

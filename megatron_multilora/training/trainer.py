"""The multi-LoRA trainer: N adapter jobs on one frozen Megatron-core model.

:meth:`Trainer.setup` builds the run: its runtime (the parallel layout, tokenizer, model
with its adapter slots and the step, shared with the training service), the job board (every job's data), the serve mailbox, a resumed
checkpoint and the submitted jobs the run's journal adds later, the report. :meth:`~Trainer.train`
is the run loop (it reads in one screen): at each step boundary honour an agreed stop and
the mailbox's requests, admit queued jobs into free slots, run one step of every training
job, retire the jobs that ended, then log, evaluate and checkpoint on schedule.
:meth:`~Trainer.finish` puts every exported adapter on every task and says how each job ended.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch.distributed as dist

from megatron_multilora.parallel import destroy_parallel
from megatron_multilora.training.checks import job_problems, name_problems
from megatron_multilora.training.config import (
    AdapterJob,
    RunConfig,
    adapter_job,
    to_plain,
)
from megatron_multilora.training.jobs.board import JobBoard
from megatron_multilora.training.jobs.exporter import JobExporter
from megatron_multilora.training.jobs.job import Job
from megatron_multilora.training.jobs.states import (
    ACTIVE,
    FAILED,
    FINISHED,
    IDLE,
    STOPPED,
    TRAINING,
)
from megatron_multilora.training.mailbox.trainer_side import TrainerMailbox
from megatron_multilora.training.model_setup import precision_summary
from megatron_multilora.training.report.run_report import RunReport
from megatron_multilora.training.report.tables import AdapterTaskEval
from megatron_multilora.training.resume import RunCheckpoints
from megatron_multilora.training.runtime import Runtime
from megatron_multilora.training.step.micro_batches import agree
from megatron_multilora.training.stop import STOP_REQUESTED, RunStopped, received


class Trainer:
    """Trains ``run``'s adapter jobs: :meth:`setup`, :meth:`train`, then :meth:`finish` (or
    :meth:`stopped` when :meth:`train` raised RunStopped). ``run`` must have passed the
    config check (``training/checks.py``)."""

    def __init__(self, run: RunConfig) -> None:
        self.run = run

    def setup(self) -> None:
        run, tr = self.run, self.run.trainer
        self.rt = rt = Runtime.build(run)  # the layout, tokenizer, model and step
        self.is_main = dist.get_rank() == 0
        self.dp_size = rt.dp_size
        self.model = rt.model
        exporter = JobExporter(
            Path(run.run_dir), rt.model, rt.model_config, run.lora, run.hf_dir, rt.hf_model_type
        )
        self.board = JobBoard(rt, tr, exporter, self.say, on_end=self._job_ended)
        for spec in run.adapters:
            self.board.add(spec)
        self.mailbox = TrainerMailbox(
            Path(run.run_dir),
            self.is_main,
            self.dp_size,
            self._job_problems,
            {"max_rank": run.lora.max_rank, "slots": run.lora.slots},
        )
        self.checkpoints = RunCheckpoints(run, self.model, self.board, self.is_main, self.say)
        self.step = self.checkpoints.resume()
        for job in self.mailbox.replay(self.step, {job.name for job in self.board.jobs}):
            self.board.add(adapter_job(job, f"submitted job {job['name']}"), source="submitted")
        self._agreed: tuple[int, ...] | None = None  # (stop signal, requests) of the last step
        self.report = RunReport(
            run, self.is_main, {**to_plain(run), "model": dataclasses.asdict(rt.model_config)}
        )
        self.tasks = AdapterTaskEval(rt.step, rt.tokenizer, tr.max_new_tokens)
        self.say(self._summary())

    def train(self) -> None:
        """The run loop: boundary -> admit -> step (the jobs whose turn it is) -> retire ->
        log / eval / save."""
        tr, board = self.run.trainer, self.board
        self.report.begin(self.step, board.planned(self.step))
        self._status(TRAINING)
        while tr.max_steps is None or self.step < tr.max_steps:
            self._boundary()  # an agreed stop: checkpoint, RunStopped; requests: jobs added, cancelled
            if board.admit(self.step):
                self._status(TRAINING)
            active = board.active()
            if not active:
                if board.finished() and not tr.serve:
                    break
                self._wait_or_skip()
                continue
            stats = self.train_one_step(board.turn(active))
            self.step += 1
            self.report.stepped(self.step, stats)
            if board.retire(self.step):
                self._status(TRAINING)
            self._on_schedule()
        self.report.end_training()
        self._save()
        for group in board.in_turns(board.active()):  # cut short by trainer.max_steps
            for job in group:
                board.exporter.export(job)

    def train_one_step(self, active: list[Job]) -> dict[str, dict[str, float]]:
        """One trainer step of the ``active`` jobs (in device slots); returns the metrics of
        those that stepped."""
        work, tokens, order = self.board.global_batch(self.step, active)
        active = [job for job in active if job.status == ACTIVE]  # a reward may have failed one
        lrs = {job.slot: job.optimizer.lr for job in active}  # what this step uses
        result = self.rt.step.train(work, slot_order=order, extras=self._local_extras())
        self._agreed = result.extras  # for the coming step boundary
        return self.board.record(self.step, active, result, tokens, lrs)

    def _boundary(self) -> None:
        """Stop here (checkpoint, RunStopped) if any rank got a stop signal or ``mmlora stop``
        was asked; then take the mailbox's requests (the count every rank agreed on)."""
        agreed, self._agreed = self._agreed, None
        if agreed is None:  # no step since the last boundary agreed on it
            agreed = agree([], 0, self._local_extras()).extras
        signum, requests = agreed
        if signum:
            checkpoint = self._save()
            if signum == STOP_REQUESTED:
                self.mailbox.stop_honoured()
            self._status(STOPPED)
            raise RunStopped(signum, self.step, checkpoint)
        added, cancels = (
            self.mailbox.decide(self.step, self.board, self.say)
            if requests
            else ([], self.mailbox.cancels_at(self.step))
        )
        for spec in added:
            job = self.board.add(
                adapter_job(spec, f"submitted job {spec['name']}"), source="submitted"
            )
            self.say(
                f"step {self.step}: submitted job {job.name} joins the queue "
                f"({job.total_steps} steps)"
            )
        for name in cancels:
            self.board.cancel(name, self.step)
        if requests or cancels:
            self._status(TRAINING)
        if requests:  # jobs added or cancelled: the plan changed
            self.report.progress.set_total(self.board.planned(self.step), self.step)

    def _job_ended(self, job: Job, step: int) -> None:
        self.report.job_ended(step, job.name, self.board)

    def _local_extras(self) -> tuple[int, int]:
        """What this rank brings to the step's agreement: the stop signal it got (or
        ``mmlora stop``'s) and how many requests wait in the mailbox (rank 0)."""
        stop = received() or (STOP_REQUESTED if self.mailbox.stop_requested() else 0)
        return stop, self.mailbox.pending()

    def _wait_or_skip(self) -> None:
        if self.board.finished():  # serving: wait for submissions, sleeping
            self._status(IDLE, force=False)
            time.sleep(self.run.trainer.serve_poll_seconds)
            self.report.restart_window(self.step)
        else:  # every remaining job starts later
            self.step += 1

    def _on_schedule(self) -> None:
        tr, every = self.run.trainer, self.run.checkpoint.save_interval
        if self.step % tr.log_interval == 0 or self.board.finished():
            self.report.log_train(self.step, self.board)
            self._status(TRAINING, force=False)
        if tr.eval_interval and self.step % tr.eval_interval == 0:
            self.report.log_eval(self.step, self.board, self.tasks)
        if every and self.step % every == 0:
            self._save()

    def _save(self) -> Path:
        return self.checkpoints.save(self.step, self.report.logger.records)

    def _status(self, state: str, force: bool = True) -> None:
        self.mailbox.write_status(state, self.step, self.board, self.report.seconds_per_step, force)

    def _job_problems(self, job: AdapterJob, where: str) -> list[str]:
        where = f"{where}: "
        tr = self.run.trainer
        return name_problems(job.name, where) + job_problems(
            job,
            where,
            self.run.lora.max_rank,
            self.dp_size,
            tr.max_seq_len,
            cuda_graphs=tr.cuda_graphs,
        )

    def stopped(self, stop: RunStopped) -> str:
        """Say where a stopped run can be resumed (returns the line); close the logger, tear
        down the layout."""
        line = (
            f"{stop}. Resume it with the same command (checkpoint.resume=auto, the "
            f"default) or with checkpoint.resume={stop.checkpoint}."
        )
        self.say(line)
        self.report.logger.close()
        destroy_parallel()
        return line

    def final_on_stop(self, stop: RunStopped) -> None:
        """A serving run ended by ``mmlora stop`` ends as a training run does: every exported
        adapter (the jobs that ran) on every task, the tables and plots; its unfinished jobs
        resume from the stop's checkpoint. A signal's stop (Ctrl-C, SIGTERM) stays quick:
        the launcher kills the workers 30 s after it."""
        if self.run.trainer.serve and stop.signum == STOP_REQUESTED:
            self.report.final(self.step, self.board, self.tasks, stopped=True)
            dist.barrier()

    def finish(self) -> list[str]:
        """Evaluate every exported adapter on every task, print the tables and how each job
        ended; returns the names of the jobs that failed."""
        self._status(FINISHED)
        self.report.final(self.step, self.board, self.tasks)
        dist.barrier()
        return [job.name for job in self.board.jobs if job.status == FAILED]

    def say(self, line: str) -> None:
        if dist.get_rank() == 0:
            print(line, flush=True)

    def _summary(self) -> str:
        run, par = self.run, self.run.parallel
        trainable = sum(
            p.numel() for chunk in self.model for p in chunk.parameters() if p.requires_grad
        )
        at_once = self.board.max_active
        turns = (
            f" ({at_once} at once, taking turns; an adapter waiting for its turn takes "
            f"{self.rt.table.page_bytes() / 2**20:.1f} MiB of host memory)"
            if at_once > run.lora.slots
            else ""
        )
        return (
            f"run {run.run_dir}: {len(run.adapters)} adapter jobs on {run.lora.slots} slots"
            f"{turns}, "
            f"world {dist.get_world_size()} (tp {par.tp}, sp {par.sp}, ep {par.ep}, pp {par.pp}"
            f"{f' x vpp {par.vpp}' if par.vpp else ''}, dp {self.dp_size}), "
            f"{precision_summary(run)}, {trainable:,} trainable parameters per rank, "
            f"starting at step {self.step}"
        )

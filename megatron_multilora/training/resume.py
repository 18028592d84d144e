"""A run's place in its run directory: where it starts (a checkpoint to resume, or step 0 with
an earlier run's outputs moved aside) and its checkpoints, each step saved once."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from megatron_multilora.atomic_files import first_free
from megatron_multilora.checkpoint.files import manifest_entries
from megatron_multilora.layers.lifecycle import ModelOrChunks
from megatron_multilora.training.checkpoints import (
    KeptFile,
    find_resume_point,
    job_file,
    prepare_checkpoint_folder,
    read_job_file,
    read_training_state,
    restore_rng,
    restore_slot,
    save_training_checkpoint,
    saved_jobs,
    slot_snapshot,
)
from megatron_multilora.training.config import RunConfig, adapter_job
from megatron_multilora.training.jobs.board import JobBoard
from megatron_multilora.training.jobs.job import Job
from megatron_multilora.training.mailbox.folder import SERVE_DIR
from megatron_multilora.training.report.metrics import METRICS_FILE, keep_first_records
from megatron_multilora.training.step.slot_optimizer import SlotOptimizer

# What a run writes into run_dir (its recorded hydra/ config aside): moved to
# run_dir/previous/<n> when a run starts over there, so nothing is overwritten or mixed.
RUN_OUTPUTS = (
    METRICS_FILE,
    "checkpoints",
    "adapters",
    "peft",
    "wandb",
    "loss_curves.png",
    "adapter_task_loss.png",
)


class RunCheckpoints:
    """``run``'s checkpoints of ``board``'s jobs on ``model`` (collective calls)."""

    def __init__(
        self,
        run: RunConfig,
        model: ModelOrChunks,
        board: JobBoard,
        is_main: bool,
        say: Callable[[str], None],
    ) -> None:
        self.run, self.run_dir, self.model, self.board = run, Path(run.run_dir), model, board
        self.is_main, self.say = is_main, say
        self.saved: tuple[int, Path] | None = None  # (step, folder) of the last checkpoint
        # Each training job's file in the last checkpoint, and its version then.
        self._files: dict[str, tuple[tuple[int, int], KeptFile]] = {}

    def resume(self) -> int:
        """Continue from the newest intact checkpoint (``checkpoint.resume=auto``; damaged
        newer ones are set aside) or the one given, restoring the jobs (submitted ones too),
        adapters, optimizers and metrics; or start at step 0 (``never``, or nothing saved
        yet), moving an earlier run's outputs aside. Returns the step."""
        point = find_resume_point(self.run_dir, self.run.checkpoint.resume)
        for note in point.notes:
            self.say(note)
        if point.path is None:
            if self.is_main:
                self._move_previous_run_aside()
            dist.barrier()
            return 0
        if self.is_main:
            for line in prepare_checkpoint_folder(self.run_dir, point):
                print(line, flush=True)
        dist.barrier()
        saved = read_training_state(point.path)
        for job in saved["trainer"].get("submitted", []):  # added before the checkpoint
            self.board.add(adapter_job(job, f"submitted job {job['name']}"), source="submitted")
        self.board.restore(saved["trainer"]["queue"])
        self._restore_jobs(point.path, saved)
        restore_rng(point.path, saved)
        self.saved = (saved["step"], point.path)
        if self.is_main:
            keep_first_records(self.run_dir / METRICS_FILE, saved["trainer"]["metrics_records"])
            print(f"resumed from {point.path} at step {saved['step']}", flush=True)
        return saved["step"]

    def _restore_jobs(self, path: Path, saved: dict) -> None:
        """Each training job's adapter and optimizer, as many at a time as there are device
        slots (the others wait paged out, as in the run saved)."""
        files = saved_jobs(saved)
        active = self.board.active()
        for job in active:
            job.slot = None  # the saved run's slots: each job is placed anew
        entries = manifest_entries(path)
        for group in self.board.in_turns(active):
            for job in group:
                job.optimizer = SlotOptimizer(self.model, job.slot, job.spec, job.total_steps)
                self.board.table.bind(job.name, job.optimizer)
                name, meta = files[job.name]
                restore_slot(self.model, job.slot, meta, read_job_file(path, name), job.optimizer)
                self._files[job.name] = (
                    self._version(job),
                    KeptFile(path / name, meta, entries[name]),
                )

    def _unchanged(self, active: list[Job]) -> dict[str, KeptFile]:
        """The jobs whose file in the last checkpoint is still their state, as rank 0 (the
        one that writes) finds those files: every rank decides alike."""
        same = [
            job.name
            for job in active
            if job.name in self._files and self._files[job.name][0] == self._version(job)
        ]
        found = [[n for n in same if self._files[n][1].path.exists()] if self.is_main else None]
        dist.broadcast_object_list(found, src=0)
        return {name: self._files[name][1] for name in found[0]}

    @staticmethod
    def _version(job: Job) -> tuple[int, int]:
        # A job's file changes only when its optimizer steps (or it starts anew).
        return id(job.optimizer), job.optimizer.steps

    def save(self, step: int, metrics_records: int) -> Path:
        """Checkpoint ``step``, once: a step already saved (or resumed from) is not written
        again. ``metrics_records``: the records logged so far (a resume keeps those). A job
        that has not stepped since the last checkpoint keeps that checkpoint's file (linked,
        not written)."""
        if self.saved is None or self.saved[0] != step:
            active = self.board.active()
            kept = self._unchanged(active)
            snapshots = {}
            for group in self.board.in_turns([job for job in active if job.name not in kept]):
                for job in group:
                    snapshots[job.name] = slot_snapshot(self.model, job.slot, job.optimizer)
            path = save_training_checkpoint(
                self.run_dir,
                step,
                snapshots,
                {
                    "queue": self.board.progress(),
                    "metrics_records": metrics_records,
                    "adapters": {job.name: self.board.exporter.meta(job) for job in active},
                    "submitted": [
                        dataclasses.asdict(job.spec)
                        for job in self.board.jobs
                        if job.source == "submitted"
                    ],
                },
                self.run.checkpoint.keep_last,
                kept,
            )
            self.saved = (step, path)
            entries = manifest_entries(path) if self.is_main else {}
            self._files = {
                job.name: (
                    self._version(job),
                    KeptFile(
                        path / job_file(job.name),
                        kept[job.name].meta if job.name in kept else _meta(snapshots[job.name]),
                        entries.get(job_file(job.name), {}),
                    ),
                )
                for job in active
            }
        return self.saved[1]

    def _move_previous_run_aside(self) -> None:
        # A run starting over on purpose also leaves the earlier submissions behind; one that
        # found no checkpoint (killed before its first) replays them (JobRequests.replay).
        never = self.run.checkpoint.resume == "never"
        outputs = RUN_OUTPUTS + ((SERVE_DIR,) if never else ())
        found = [name for name in outputs if (self.run_dir / name).exists()]
        if not found:
            return
        dest = first_free(self.run_dir / "previous" / str(n) for n in itertools.count(1))
        dest.mkdir(parents=True)
        for name in found:
            os.replace(self.run_dir / name, dest / name)
        why = "checkpoint.resume=never" if never else "no checkpoint to resume"
        print(
            f"{self.run_dir} holds an earlier run ({why}): starting at step 0, its outputs "
            f"({', '.join(found)}) moved to {dest}",
            flush=True,
        )


def _meta(snapshot: dict) -> dict:
    return {n: v for n, v in snapshot.items() if n != "tensors"}

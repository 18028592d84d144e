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
from megatron_multilora.layers.lifecycle import ModelOrChunks
from megatron_multilora.training.checkpoints import (
    find_resume_point,
    prepare_checkpoint_folder,
    read_training_state,
    restore_training_checkpoint,
    save_training_checkpoint,
)
from megatron_multilora.training.config import RunConfig, adapter_job
from megatron_multilora.training.jobs.board import JobBoard
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
        by_slot = {job.slot: job for job in self.board.active()}
        optimizers = restore_training_checkpoint(
            point.path,
            saved,
            self.model,
            lambda slot: SlotOptimizer(
                self.model, slot, by_slot[slot].spec, by_slot[slot].total_steps
            ),
        )
        for slot, optimizer in optimizers.items():
            by_slot[slot].optimizer = optimizer
        self.saved = (saved["step"], point.path)
        if self.is_main:
            keep_first_records(self.run_dir / METRICS_FILE, saved["trainer"]["metrics_records"])
            print(f"resumed from {point.path} at step {saved['step']}", flush=True)
        return saved["step"]

    def save(self, step: int, metrics_records: int) -> Path:
        """Checkpoint ``step``, once: a step already saved (or resumed from) is not written
        again. ``metrics_records``: the records logged so far (a resume keeps those)."""
        if self.saved is None or self.saved[0] != step:
            active = self.board.active()
            path = save_training_checkpoint(
                self.run_dir,
                step,
                self.model,
                {job.slot: job.optimizer for job in active},
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
            )
            self.saved = (step, path)
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

"""The trainer's side of the run directory's mailbox: decisions on requests at a step
boundary, taken on rank 0 (journaled before they take effect, :mod:`.decisions`) and
broadcast, and the status report ``mmlora status`` reads."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_multilora.training.config import AdapterJob, ConfigError, adapter_job
from megatron_multilora.training.jobs.board import JobBoard
from megatron_multilora.training.jobs.states import ACTIVE, ENDED
from megatron_multilora.training.mailbox import folder
from megatron_multilora.training.mailbox.decisions import JobRequests

# problems(job, where): what the run's checks find wrong with a submitted job now
JobCheck = Callable[[AdapterJob, str], list[str]]


class TrainerMailbox:
    """``run_dir``'s requests for a run of ``dp_size`` data-parallel ranks; ``check`` re-checks
    each submission when it is decided on (``mmlora submit`` checked it, but files and the run
    may have changed since, and anyone can write the folder)."""

    def __init__(
        self, run_dir: Path, is_main: bool, dp_size: int, check: JobCheck, report: dict[str, Any]
    ) -> None:
        self.run_dir, self.is_main, self.dp_size, self.check = run_dir, is_main, dp_size, check
        self.report = report  # constant fields of every status report (slots, max rank)
        self.requests = JobRequests(run_dir)
        self._status_time = 0.0  # when status.json was last written

    def pending(self) -> int:
        """Requests waiting for a decision (rank 0 looks; the others say 0)."""
        return self.requests.pending() if self.is_main else 0

    def stop_requested(self) -> bool:
        return self.is_main and folder.stop_requested(self.run_dir)

    def stop_honoured(self) -> None:
        """A resumed run trains on."""
        if self.is_main:
            folder.clear_stop_request(self.run_dir)

    def replay(self, step: int, known: set[str]) -> list[dict[str, Any]]:
        return self.requests.replay(step, known)

    def decide(
        self, step: int, board: JobBoard, say: Callable[[str], None]
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """The submitted jobs to add at this boundary and the jobs to cancel now: rank 0
        decides, every rank gets the same decision."""
        decision = [None]
        if self.is_main:
            decision = [
                self.requests.decide(
                    step,
                    {job.name for job in board.jobs},
                    {job.name for job in board.jobs if job.status in ENDED},
                    self._checked,
                    say,
                )
            ]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(decision, src=0)
        return decision[0]["add"], self.requests.cancels_at(step, decision[0]["cancel"])

    def cancels_at(self, step: int) -> list[str]:
        """Cancels a resumed run replays at this boundary (no request pending)."""
        return self.requests.cancels_at(step, [])

    def _checked(self, sub: folder.Submission) -> tuple[AdapterJob | None, list[str]]:
        where = f"submitted job {sub.name}"
        try:
            job = adapter_job(sub.job, where)
        except ConfigError as err:
            return None, [str(err)]
        return job, self.check(job, where)

    def write_status(
        self,
        state: str,
        step: int,
        board: JobBoard,
        seconds_per_step: float | None,
        force: bool = True,
    ) -> None:
        """Rank 0: the run's state and a row per job; routine updates (``force=False``) at
        most once a second (each is a synced file write)."""
        if not self.is_main or (not force and time.time() - self._status_time < 1.0):
            return
        self._status_time = time.time()
        rows = []
        for job in board.jobs:
            left = job.total_steps - job.steps_done
            rows.append(
                {
                    "name": job.name,
                    "status": job.status,
                    "slot": job.slot,
                    "steps_done": job.steps_done,
                    "total_steps": job.total_steps,
                    "loss": job.metrics.get("loss"),
                    "eval_loss": job.metrics.get("eval_loss"),
                    "tokens_per_s": job.metrics.get("tokens_per_s"),
                    "eta_s": (
                        left * seconds_per_step
                        if job.status == ACTIVE and seconds_per_step
                        else None
                    ),
                    "source": job.source,
                }
            )
        folder.write_status(
            self.run_dir,
            {
                "state": state,
                "step": step,
                "updated_at": time.time(),
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "dp_size": self.dp_size,
                **self.report,
                "jobs": rows,
            },
        )

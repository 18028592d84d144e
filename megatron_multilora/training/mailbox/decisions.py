"""Serve mode's decisions: what the run directory's mailbox (:mod:`.folder`) asks for,
turned into the jobs to add and cancel at a step boundary.

Rank 0 counts the pending requests before each step (the count rides in the step's
agreement) and, at the boundary, decides: each new submission is checked again and added
(with ``start_step`` = that step) or refused, each new cancel request for a job of the run
that has not ended is granted. Decisions are journaled before they take effect; every rank
replays the journal from the step a run resumes at, so a resumed run adds and cancels the
same jobs at the same steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_multilora.training.config import AdapterJob
from megatron_multilora.training.mailbox import folder

# (job, problems) of a submission: the trainer's checks against the run
Check = Callable[[folder.Submission], tuple[AdapterJob | None, list[str]]]


class JobRequests:
    """The run's journal and requests. ``replay`` once after the checkpoint is loaded."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.decided: set[str] = set()  # submissions added or refused
        self.cancel_handled: set[str] = set()
        self.cancels: dict[int, list[str]] = {}  # step -> jobs cancelled at that boundary

    def replay(self, step: int, known: set[str]) -> list[dict[str, Any]]:
        """Read the journal: the jobs added from ``step`` on that are not ``known`` (in journal
        order, each with its start step), and the cancellations from ``step`` on scheduled
        for their boundaries; earlier decisions are the checkpoint's state."""
        jobs = []
        for event in folder.read_events(self.run_dir):
            (self.cancel_handled if event["event"] == "cancel" else self.decided).add(event["name"])
            if event["step"] < step:
                continue
            if event["event"] == "add" and event["name"] not in known:
                jobs.append(event["job"])
            elif event["event"] == "cancel":
                self.cancels.setdefault(event["step"], []).append(event["name"])
        return jobs

    def pending(self) -> int:
        """Rank 0, before each step: submissions not decided yet and cancel requests not
        handled yet (file names only: cheap enough for every step)."""
        return len(folder.submitted_names(self.run_dir) - self.decided) + len(
            folder.cancel_requests(self.run_dir) - self.cancel_handled
        )

    def decide(
        self, step: int, names: set[str], ended: set[str], check: Check, say: Callable[[str], None]
    ) -> dict[str, list]:
        """Rank 0 at a boundary: ``{"add": [job dicts], "cancel": [names]}``, journaled.
        ``names``: the run's jobs; ``ended``: those that ended."""
        decision: dict[str, list] = {"add": [], "cancel": []}
        names = set(names)
        for sub in folder.submissions(self.run_dir, skip=self.decided):
            self.decided.add(sub.name)
            if sub.name in names:
                job, problems = None, [f"a job named {sub.name} is already in the run"]
            else:
                job, problems = check(sub)
            if problems:
                reason = "; ".join(problems)
                folder.append_event(
                    self.run_dir,
                    {"event": "refuse", "name": sub.name, "step": step, "reason": reason},
                )
                say(f"step {step}: submitted job {sub.name} refused: {reason}")
                continue
            added = {**dataclasses.asdict(job), "start_step": step}
            folder.append_event(
                self.run_dir, {"event": "add", "name": sub.name, "step": step, "job": added}
            )
            decision["add"].append(added)
            names.add(sub.name)
        for name in sorted(folder.cancel_requests(self.run_dir) - self.cancel_handled):
            self.cancel_handled.add(name)
            if name in names and name not in ended:
                folder.append_event(self.run_dir, {"event": "cancel", "name": name, "step": step})
                decision["cancel"].append(name)
        return decision

    def cancels_at(self, step: int, granted: list[str]) -> list[str]:
        """The jobs to cancel at ``step``'s boundary: replayed ones and ``granted``."""
        return self.cancels.pop(step, []) + granted

"""A running trainer's mailbox in its run directory: submitted jobs, cancel and stop requests,
the trainer's journal of what it decided, and its status for ``mmlora status``.

Everything lives under ``<run_dir>/serve/``, written atomically (a reader sees a whole file
or none), so the command line and the trainer need nothing but the file system:

* ``submitted/<name>.json``: an accepted job (the fields of an ``adapters`` entry) and when it
  was submitted. It lands with a hard link of a complete temporary file, which fails if the
  name exists: of two racing submissions of one name exactly one lands, whole.
* ``cancel/<name>``: stop that job at the next step boundary; ``stop``: end the run after the
  current step with a checkpoint.
* ``events.jsonl``: the trainer's decisions, one JSON line each (``add`` a submitted job to
  the run's queue, ``refuse`` it, ``cancel`` a job, each at a step), appended and synced
  before they take effect, so a resumed run replays them at the same steps.
* ``status.json``: the trainer's last report (its state, step and a row per job).

Pure file handling: no torch, so the command line stays fast.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_multilora.atomic_files import atomic_file, write_json_atomic

SERVE_DIR = "serve"
EVENTS_FILE = "events.jsonl"
STATUS_FILE = "status.json"


def serve_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / SERVE_DIR


@dataclass(frozen=True)
class Submission:
    """An accepted job: ``job`` holds its ``adapters`` fields (paths made absolute)."""

    name: str
    job: dict[str, Any]
    submitted_at: float


def submit(run_dir: str | Path, job: dict[str, Any]) -> Path:
    """Land ``job`` (already validated) as ``serve/submitted/<name>.json``; raises
    FileExistsError, writing nothing, when a job of that name was submitted before."""
    target = serve_dir(run_dir) / "submitted" / f"{job['name']}.json"
    write_json_atomic(target, {"job": job, "submitted_at": time.time()}, exclusive=True)
    return target


def submitted_names(run_dir: str | Path) -> set[str]:
    """The names of every landed submission (the folder listing only)."""
    folder = serve_dir(run_dir) / "submitted"
    if not folder.is_dir():
        return set()
    return {
        entry[: -len(".json")]
        for entry in os.listdir(folder)
        if entry.endswith(".json") and not entry.startswith(".")
    }


def submissions(
    run_dir: str | Path, skip: frozenset[str] | set[str] = frozenset()
) -> list[Submission]:
    """The landed submissions whose names are not in ``skip``, oldest first (ties by name);
    only those files are read."""
    found = []
    for name in submitted_names(run_dir) - set(skip):
        path = serve_dir(run_dir) / "submitted" / f"{name}.json"
        record = json.loads(path.read_text(encoding="utf-8"))
        found.append(Submission(name, record["job"], float(record["submitted_at"])))
    return sorted(found, key=lambda s: (s.submitted_at, s.name))


def request_cancel(run_dir: str | Path, name: str) -> Path:
    """Ask the trainer to cancel job ``name`` at its next step boundary."""
    path = serve_dir(run_dir) / "cancel" / name
    with atomic_file(path) as f:
        f.write(f"{time.time()}\n")
    return path


def cancel_requests(run_dir: str | Path) -> set[str]:
    folder = serve_dir(run_dir) / "cancel"
    return (
        {p.name for p in folder.iterdir() if not p.name.startswith(".")}
        if folder.is_dir()
        else set()
    )


def request_stop(run_dir: str | Path) -> Path:
    """Ask the trainer to stop after its current step, with a checkpoint."""
    path = serve_dir(run_dir) / "stop"
    with atomic_file(path) as f:
        f.write(f"{time.time()}\n")
    return path


def stop_requested(run_dir: str | Path) -> bool:
    return (serve_dir(run_dir) / "stop").exists()


def clear_stop_request(run_dir: str | Path) -> None:
    """The stop was honoured: a resumed run trains on."""
    (serve_dir(run_dir) / "stop").unlink(missing_ok=True)


def append_event(run_dir: str | Path, event: dict[str, Any]) -> None:
    """Append one decision to the journal and sync it before it takes effect."""
    path = serve_dir(run_dir) / EVENTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(event) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """The journal's decisions in order; a last line cut short by a kill is left out."""
    path = serve_dir(run_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break  # only the last line can be torn (appends are synced one by one)
    return events


def write_status(run_dir: str | Path, status: dict[str, Any]) -> None:
    write_json_atomic(serve_dir(run_dir) / STATUS_FILE, status)


def read_status(run_dir: str | Path) -> dict[str, Any] | None:
    path = serve_dir(run_dir) / STATUS_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

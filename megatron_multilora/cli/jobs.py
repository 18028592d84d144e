"""``mmlora submit | status | cancel | stop``: talk to a serving training run.

A run launched with ``trainer.serve=true`` admits jobs at step boundaries; these commands talk
to it only through the run directory's mailbox (:mod:`megatron_multilora.training.mailbox.folder`),
so they work on any machine that sees the run directory, whether the trainer is up or not.
Torch-free: each answers in a fraction of a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_multilora.cli.command import CommandError, Commands
from megatron_multilora.training.jobs.states import ENDED, RUNNING
from megatron_multilora.training.mailbox import folder

if TYPE_CHECKING:
    from megatron_multilora.training.config import AdapterJob, RunConfig

PATH_FIELDS = ("dataset", "eval_dataset", "init_from")


# ---------------------------------------------------------------------------------------------
# The run directory and the trainer


def _run_config_path(run_dir: str) -> Path:
    path = Path(run_dir) / "hydra" / "config.yaml"
    if not path.is_file():
        raise CommandError(
            f"{run_dir} is not a run directory ({path} does not exist): launch the trainer "
            f"first, e.g. `mmlora train --nproc 2 run_dir={run_dir} trainer.serve=true`, or "
            "pass the --run-dir of a launched run"
        )
    return path


def _load_run(run_dir: str) -> RunConfig:
    # Imported here: only submit and cancel need the config schema.
    from omegaconf import OmegaConf

    from megatron_multilora.training.config import ConfigError, load_run_config

    path = _run_config_path(run_dir)
    try:
        return load_run_config(OmegaConf.load(path))
    except (ConfigError, OSError, ValueError) as err:
        raise CommandError(
            f"{path}: the run's recorded config cannot be read ({err}); pass the "
            "--run-dir of a run launched by this version"
        ) from None


def _trainer_alive(status: dict[str, Any] | None) -> bool | None:
    """Whether the reporting trainer process lives; None when it runs on another host
    (its pid means nothing here) or never reported."""
    if status is None or status.get("pid") is None or status.get("host") != socket.gethostname():
        return None
    try:
        os.kill(int(status["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _trainer_running(status: dict[str, Any] | None) -> bool:
    """Whether a trainer will see a request soon (a trainer on another host is assumed up
    unless it reported that it stopped)."""
    return (
        status is not None
        and status.get("state") in RUNNING
        and _trainer_alive(status) is not False
    )


def _when_seen(status: dict[str, Any] | None) -> str:
    if _trainer_running(status):
        return "at its next step boundary"
    return "when the run is resumed (the trainer is not running; relaunch it with the same command)"


# ---------------------------------------------------------------------------------------------
# submit


def submit(args: argparse.Namespace) -> int:
    run = _load_run(args.run_dir)
    status = folder.read_status(args.run_dir)
    spec = _read_spec(args.spec)
    job = _validated_job(spec, args.spec, run, status, args.run_dir)
    # normalised types, absolute paths; an objective's settings as plain values
    stored = {
        key: dataclasses.asdict(v) if dataclasses.is_dataclass(v := getattr(job, key)) else v
        for key in spec
    }
    try:
        folder.submit(args.run_dir, stored)
    except FileExistsError:  # a racing submission of the same name landed first
        raise CommandError(_already_submitted(args.spec, job.name)) from None
    print(f"submitted job {job.name} to {args.run_dir}: the trainer adds it {_when_seen(status)}")
    return 0


def _read_spec(path: str) -> dict[str, Any]:
    import yaml  # JSON is YAML too: one parser for both

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CommandError(f"{path}: cannot read the job spec ({err})") from None
    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise CommandError(
            f"{path}: not valid YAML or JSON ({err}); write one mapping of an "
            "`adapters` entry's fields"
        ) from None
    if not isinstance(spec, dict) or not all(isinstance(k, str) for k in spec):
        raise CommandError(
            f"{path}: expected one mapping of an `adapters` entry's fields "
            f"(name, dataset, rank, ...), got {type(spec).__name__}"
        )
    return spec


def _validated_job(
    spec: dict[str, Any], where: str, run: RunConfig, status: dict[str, Any] | None, run_dir: str
) -> AdapterJob:
    """The spec as a job with absolute paths; raises CommandError listing every problem."""
    from megatron_multilora.training.checks import job_problems
    from megatron_multilora.training.config import ConfigError, adapter_job

    problems, usable = _field_problems(spec, where)
    job = None
    if usable is not None:
        try:
            job = adapter_job(usable, where)
        except ConfigError as err:  # what the field-by-field checks cannot see
            problems.append(str(err))
    name = job.name if job is not None else spec.get("name")
    if isinstance(name, str):
        problems += _name_problems(name, where, run, run_dir)
    if job is not None:
        for field in PATH_FIELDS:  # relative to where the command runs, not the trainer
            if getattr(job, field) is not None:
                setattr(job, field, os.path.abspath(os.path.expanduser(getattr(job, field))))
        dp = int(status.get("dp_size", 1)) if status else 1
        tr = run.trainer
        problems += job_problems(
            job, f"{where}: ", run.lora.max_rank, dp, tr.max_seq_len, True, tr.cuda_graphs
        )
    if problems:
        raise CommandError(
            f"the job in {where} cannot be submitted; fix it and submit again:"
            "\n  - " + "\n  - ".join(problems)
        )
    return job


def _field_problems(spec: dict[str, Any], where: str) -> tuple[list[str], dict[str, Any] | None]:
    """Unknown, forbidden, missing and mistyped fields, each checked on its own so that all
    of them are reported at once; and the fields the per-job checks can run on (None when a
    field they need is missing or mistyped: checking a default instead would mislead)."""
    from omegaconf import MISSING, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from megatron_multilora.training.config import AdapterJob

    fields = [f.name for f in dataclasses.fields(AdapterJob) if f.name != "start_step"]
    required = [f.name for f in dataclasses.fields(AdapterJob) if f.default == MISSING]
    problems, usable, complete = [], {}, True
    for key, value in spec.items():
        if key == "start_step":
            problems.append(
                f"{where}: start_step: remove it; the trainer sets it to the step at "
                "which it adds the job"
            )
        elif key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(
                f"{where}: unknown key {key!r}; {hint}an adapters entry has the "
                f"fields {', '.join(fields)}"
            )
        elif value is None and key in required:
            complete = False  # reported as missing below
        else:
            try:
                OmegaConf.merge(OmegaConf.structured(AdapterJob), {key: value})
                usable[key] = value
            except OmegaConfBaseException as err:
                problems.append(f"{where}: {key}: {str(err.msg).splitlines()[0]}")
                complete = False
    for key in required:
        if spec.get(key) is None:
            problems.append(f"{where}: {key}: missing; every job needs a {key}")
            complete = False
    return problems, usable if complete else None


def _name_problems(name: str, where: str, run: RunConfig, run_dir: str) -> list[str]:
    from megatron_multilora.training.checks import name_problems

    if problems := name_problems(name, f"{where}: "):
        return problems
    if name in {job.name for job in run.adapters}:
        return [f"{where}: name={name!r} is already a job of the run's config; choose another name"]
    if name in folder.submitted_names(run_dir):
        return [_already_submitted(where, name)]
    return []


def _already_submitted(where: str, name: str) -> str:
    return (
        f"{where}: name={name!r}: a job of that name was already submitted to this run; "
        "choose another name (see `mmlora status`)"
    )


# ---------------------------------------------------------------------------------------------
# status


def status(args: argparse.Namespace) -> int:
    _run_config_path(args.run_dir)
    report = run_report(args.run_dir)
    print(json.dumps(report, indent=2) if args.json else _render(report))
    return 0


def run_report(run_dir: str) -> dict[str, Any]:
    """The trainer's status merged with what it has not reported yet: submissions it has not
    seen, pending cancel requests, refused submissions (with the reason)."""
    reported = folder.read_status(run_dir)
    trainer = {k: v for k, v in (reported or {}).items() if k != "jobs"} or None
    rows = [dict(row) for row in (reported or {}).get("jobs", [])]
    known = {row["name"] for row in rows}
    decided = {
        e["name"]: e for e in folder.read_events(run_dir) if e.get("event") in ("add", "refuse")
    }
    for sub in folder.submissions(run_dir, skip=known):
        rows.append(_submission_row(sub, decided.get(sub.name)))
    cancelling = folder.cancel_requests(run_dir)
    for row in rows:
        row["cancel_requested"] = row["name"] in cancelling and row["status"] not in ENDED
    return {
        "run_dir": str(run_dir),
        "trainer": trainer,
        "trainer_alive": _trainer_alive(reported),
        "stop_requested": folder.stop_requested(run_dir),
        "jobs": rows,
    }


def _submission_row(sub: folder.Submission, event: dict[str, Any] | None) -> dict[str, Any]:
    # "added": the trainer took it but has not reported since.
    state = {None: "submitted", "add": "added", "refuse": "refused"}[event and event["event"]]
    row = {
        "name": sub.name,
        "status": state,
        "slot": None,
        "steps_done": 0,
        "total_steps": sub.job.get("max_steps"),
        "source": "submitted",
        "submitted_at": sub.submitted_at,
    }
    if state == "refused":
        row["reason"] = event.get("reason", "")
        row["refused_at_step"] = event.get("step")
    return row


def _render(report: dict[str, Any]) -> str:
    lines = [_header(report), *_memory(report), ""]
    columns = ("NAME", "STATE", "SLOT", "STEP", "LOSS", "EVAL LOSS", "TOKENS/S", "ETA")
    cells = [columns] + [_cells(row) for row in report["jobs"]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    if not report["jobs"]:
        lines.append("(no jobs)")
    lines += [
        f"refused {row['name']} at step {row.get('refused_at_step')}: {row['reason']}"
        for row in report["jobs"]
        if row["status"] == "refused"
    ]
    return "\n".join(lines)


def _memory(report: dict[str, Any]) -> list[str]:
    """A service's kept structures in all, then per tenant (``api/memory.py``)."""
    memory = (report["trainer"] or {}).get("memory")
    if not memory:
        return []

    def sizes(row: dict[str, Any]) -> str:
        parts = []
        for what, value in row.items():
            count, nbytes = (
                (value["count"], value.get("bytes"))
                if isinstance(value, dict)
                else ((value[0], value[1]) if isinstance(value, list) else (value, None))
            )
            size = "" if nbytes is None else f" ({nbytes / 2**20:.1f} MiB)"
            parts.append(f"{what.replace('_', ' ')} {count}{size}")
        return ", ".join(parts)

    rss = memory.get("rss_mib")
    lines = [
        f"memory: {'?' if rss is None else f'{rss:,.0f}'} MiB resident (rank 0); kept: "
        f"{sizes(memory['in_all'])}"
    ]
    lines += [f"  {owner}: {sizes(row)}" for owner, row in sorted(memory["tenants"].items())]
    return lines


def _header(report: dict[str, Any]) -> str:
    trainer = report["trainer"]
    if trainer is None:
        head = (
            f"{report['run_dir']}: the trainer has not reported yet (no "
            f"{folder.STATUS_FILE}); showing submissions only"
        )
    else:
        alive = {
            True: "alive",
            False: "not running",
            None: f"on host {trainer.get('host')} (not checkable here)",
        }[report["trainer_alive"]]
        ago = _duration(max(time.time() - float(trainer["updated_at"]), 0.0))
        service = trainer.get("service")
        what = (
            f"training service {trainer['state']} at {service['url']} ({service['model']!r}, "
            f"{trainer['step']} calls run)"
            if service
            else f"trainer {trainer['state']} at step {trainer['step']}"
        )
        head = (
            f"{report['run_dir']}: {what}, updated {ago} ago; process {trainer.get('pid')} {alive}"
        )
    return head + ("; stop requested" if report["stop_requested"] else "")


def _cells(row: dict[str, Any]) -> tuple[str, ...]:
    state = row["status"] + (" (cancelling)" if row["cancel_requested"] else "")
    total = row.get("total_steps")
    return (
        row["name"],
        state,
        _text(row.get("slot")),
        f"{row.get('steps_done', 0)}/{'?' if total is None else total}",
        _number(row.get("loss"), ".4f"),
        _number(row.get("eval_loss"), ".4f"),
        _number(row.get("tokens_per_s"), ".0f"),
        "-" if row.get("eta_s") is None else _duration(row["eta_s"]),
    )


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _duration(seconds: float) -> str:
    """Human-friendly: 45s, 1m05s, 2h03m."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


# ---------------------------------------------------------------------------------------------
# cancel and stop


def cancel(args: argparse.Namespace) -> int:
    run = _load_run(args.run_dir)
    report = run_report(args.run_dir)
    row = next((r for r in report["jobs"] if r["name"] == args.name), None)
    if row is None and args.name not in {job.name for job in run.adapters}:
        known = sorted({j.name for j in run.adapters} | {r["name"] for r in report["jobs"]})
        raise CommandError(
            f"no job named {args.name!r} in {args.run_dir}; its jobs are: "
            f"{', '.join(known) or '(none)'} (see `mmlora status`)"
        )
    if row is not None and row["status"] in ENDED + ("refused",):
        raise CommandError(
            f"job {args.name!r} in {args.run_dir} has already ended "
            f"({row['status']}); there is nothing to cancel"
        )
    folder.request_cancel(args.run_dir, args.name)
    print(
        f"cancel of {args.name} requested: the trainer stops it "
        f"{_when_seen(report['trainer'])}, exports its adapter as it stands (if it trained) "
        "and frees its slot"
    )
    return 0


def stop(args: argparse.Namespace) -> int:
    _run_config_path(args.run_dir)
    status_now = folder.read_status(args.run_dir)
    folder.request_stop(args.run_dir)
    if _trainer_running(status_now) and status_now.get("service"):
        print(
            "stop requested: the training service stops after its current calls; its "
            "clients' saved states stay, and a restart on this run folder serves them"
        )
    elif _trainer_running(status_now):
        print(
            "stop requested: the trainer stops after its current step with a checkpoint; "
            "resume the run with the same launch command"
        )
    else:
        print(
            "stop requested, but the trainer is not running: the run, when resumed, stops "
            "after its first step with a checkpoint"
        )
    return 0


def add_commands(commands: Commands) -> None:
    commands.add(
        "submit", submit, "validate a job spec and hand it to the serving trainer", run_dir=True
    ).add_argument(
        "spec",
        help="YAML or JSON file: one `adapters` "
        "entry (name, dataset, rank, max_steps or epochs, ...)",
    )
    commands.add(
        "status", status, "show the trainer's state and every job", run_dir=True
    ).add_argument("--json", action="store_true", help="print the data as JSON")
    commands.add(
        "cancel", cancel, "stop a job at the next step boundary", run_dir=True
    ).add_argument("name", help="the job's name")
    commands.add(
        "stop", stop, "stop the run after its current step, with a checkpoint", run_dir=True
    )

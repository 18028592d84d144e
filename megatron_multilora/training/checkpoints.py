"""Training checkpoints: adapters, per-slot optimizer and schedule, the job queue (with each
job's data position) and RNG, written atomically and checked on load.

Adapter weights and Adam moments are stored as full, layout-independent tensors (gathered
from every TP/EP shard), so a run resumes under another TP/EP layout too; RNG streams are
per rank and are restored only when the world size matches.

Layout of ``<run_dir>/checkpoints/``: ``step_00000040/`` folders (``state.pt`` with the queue,
each training job's rank, alpha and scalar optimizer state, ``job.<name>.safetensors`` with its
``param/`` (the fp32 master weights), ``exp_avg/``, ``exp_avg_sq/`` tensors, ``rng.pt``, and
``manifest.json`` with every file's size and sha256, written last), ``latest.json`` naming
the newest, and ``set_aside/`` holding the folders a resume skipped (damaged, or newer than the
checkpoint resumed): those are never overwritten or pruned.

A job that has not stepped since the previous checkpoint (it waits for its turn, or the run
holds thousands) has the same file: it is hard-linked from there, not written again, and its
manifest entry reused (linked files are one file: damage to it shows in both folders'
manifests, and a resume falls back to an older folder that verifies). The files hold every value a step reads (weights, masters, moments;
the step count and schedule in ``state.pt``), so a resume is exact either way.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from safetensors.torch import load_file, save_file

from megatron_multilora.atomic_files import (
    first_free,
    remove_write_leftovers,
    write_dir_atomic,
    write_json_atomic,
)
from megatron_multilora.checkpoint.adapter_folders import CHECKPOINT_STATE
from megatron_multilora.checkpoint.files import DamagedFolderError, verify_manifest, write_manifest
from megatron_multilora.errors import RunError
from megatron_multilora.layers.lifecycle import ModelOrChunks, multi_lora_modules
from megatron_multilora.layers.slot_tensors import get_slot_tensors, set_slot_tensors
from megatron_multilora.training.step.slot_optimizer import SlotOptimizer

MOMENTS = ("exp_avg", "exp_avg_sq")
LATEST, SET_ASIDE = "latest.json", "set_aside"
_STEP_FOLDER = re.compile(r"step_(\d{8})")


class CheckpointError(RunError):
    """A checkpoint that cannot be written or resumed; the message names the file and what
    to do."""


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def job_file(name: str) -> str:
    """The file of job ``name``'s adapter and optimizer in a checkpoint folder."""
    return f"job.{name}.safetensors"


@dataclasses.dataclass(frozen=True)
class KeptFile:
    """A job's file in an earlier checkpoint, still its state (it has not stepped since):
    linked into the new checkpoint instead of written again, with its metadata and its
    manifest entry."""

    path: Path
    meta: dict[str, Any]
    entry: dict[str, Any]


def save_training_checkpoint(
    run_dir: str | Path,
    step: int,
    snapshots: dict[str, dict[str, Any]],
    state: dict[str, Any],
    keep_last: int,
    kept: dict[str, KeptFile] | None = None,
) -> Path:
    """Save after ``step`` trainer steps (collective): each training job's
    :func:`slot_snapshot` by name, or its :class:`KeptFile` where it has not changed since an
    earlier checkpoint. ``state`` is picklable trainer state."""
    kept = kept or {}
    rng = [None] * dist.get_world_size()
    dist.all_gather_object(rng, rng_state())
    root = checkpoint_root(run_dir)
    path = root / f"step_{step:08d}"
    failure = [None]
    if dist.get_rank() == 0:

        def fill(tmp: Path) -> None:
            meta = {
                **{k: {n: v for n, v in s.items() if n != "tensors"} for k, s in snapshots.items()},
                **{k: f.meta for k, f in kept.items()},
            }
            torch.save(
                {
                    "step": step,
                    "jobs": meta,
                    "trainer": state,
                    "world_size": dist.get_world_size(),
                },
                tmp / CHECKPOINT_STATE,
            )
            for k, s in snapshots.items():
                save_file(
                    {n: t.contiguous() for n, t in s["tensors"].items()}, str(tmp / job_file(k))
                )
            for k, f in kept.items():  # unchanged: the same bytes, not written again
                _link_or_copy(f.path, tmp / job_file(k))
            torch.save(rng, tmp / "rng.pt")
            # last: a folder whose manifest verifies is complete
            write_manifest(tmp, known={job_file(k): f.entry for k, f in kept.items()})

        try:
            # Never overwritten: a step is saved once, and a resume sets newer folders aside.
            write_dir_atomic(path, fill)  # a failed write leaves nothing behind
            write_json_atomic(root / LATEST, {"step": step, "path": path.name})
        except Exception as err:  # e.g. a full disk; every rank must hear of it
            failure[0] = _write_failure(path, root, err)
        else:
            for old in step_folders(root)[keep_last:] if keep_last > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise CheckpointError(failure[0])
    return path


def _link_or_copy(source: Path, dest: Path) -> None:
    """A hard link (no bytes written; the file outlives its folder's pruning), or a copy
    where the file system has none."""
    try:
        os.link(source, dest)
    except OSError:
        shutil.copyfile(source, dest)


def _write_failure(path: Path, root: Path, err: Exception) -> str:
    """What to tell the user when checkpoint ``path`` could not be written."""
    kept = step_folders(root)
    previous = (
        f"the previous checkpoint {kept[0]} is intact and is the one a resume takes"
        if kept
        else "there is no earlier checkpoint: a resume starts at step 0"
    )
    return (
        f"checkpoint {path} could not be written ({type(err).__name__}: {err}); nothing of "
        f"it is left behind and {previous}. Free disk space (or fix the folder) and resume "
        "with the same command."
    )


def step_folders(root: Path) -> list[Path]:
    """The ``step_*`` checkpoint folders in ``root``, newest first."""
    found = (
        [p for p in root.iterdir() if _STEP_FOLDER.fullmatch(p.name) and p.is_dir()]
        if root.is_dir()
        else []
    )
    return sorted(found, key=lambda p: p.name, reverse=True)


def _step_of(folder: Path) -> int:
    return int(_STEP_FOLDER.fullmatch(folder.name)[1])


@dataclasses.dataclass
class ResumePoint:
    """Where a run starts: ``path``, the checkpoint to resume (None: step 0); ``skipped``, the
    run's step folders newer than it, each with why it is not resumed (they are set aside);
    ``notes``, what else the user should hear (e.g. a missing ``latest.json``)."""

    path: Path | None
    skipped: dict[Path, str] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)


def find_resume_point(run_dir: str | Path, resume: str) -> ResumePoint:
    """The checkpoint to resume (collective: rank 0 removes what killed writes left in the
    checkpoint folder, reads and checks; every rank gets its answer or raises the same
    :class:`CheckpointError`).

    ``resume``: ``auto``, the newest intact checkpoint in ``run_dir`` (newer damaged ones are
    skipped; none at all: step 0; only damaged ones: an error), ``never`` (step 0), or an
    explicit checkpoint folder, which must be intact.
    """
    answer: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            removed = remove_write_leftovers(checkpoint_root(run_dir))
            answer[0] = _find_resume_point(Path(run_dir), resume)
            answer[0].notes[:0] = [
                f"{checkpoint_root(run_dir) / name}: removed (left by an interrupted write)"
                for name in removed
            ]
        except CheckpointError as e:
            answer[0] = e
        except Exception as e:  # the other ranks must not wait for an answer that never comes
            dist.broadcast_object_list([CheckpointError(f"rank 0 failed: {e}")], src=0)
            raise
    dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], CheckpointError):
        raise answer[0]
    return answer[0]


def _find_resume_point(run_dir: Path, resume: str) -> ResumePoint:
    folders = step_folders(checkpoint_root(run_dir))
    if resume == "never":
        return ResumePoint(None)
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(
                f"checkpoint.resume={resume}: no such folder; use auto, never, or a checkpoint "
                f"folder like {checkpoint_root(run_dir)}/step_00000040"
            )
        check_checkpoint(path)
        step = read_training_state(path)["step"]
        newer = [f for f in folders if _step_of(f) > step and f.resolve() != path.resolve()]
        return ResumePoint(path, {f: f"newer than the checkpoint resumed ({path})" for f in newer})
    damaged: dict[Path, str] = {}
    for folder in folders:
        try:
            check_checkpoint(folder)
        except CheckpointError as e:
            damaged[folder] = str(e)
            continue
        return ResumePoint(folder, damaged, _latest_notes(run_dir, folder))
    latest = checkpoint_root(run_dir) / LATEST
    if not damaged and not latest.exists():
        return ResumePoint(None)
    lines = (
        "".join(f"\n  {why}" for why in damaged.values())
        or f"\n  {latest} exists but no step_* folder does"
    )
    raise CheckpointError(
        f"no intact checkpoint to resume in {checkpoint_root(run_dir)}:{lines}\n"
        f"Restore the damaged files, pass checkpoint.resume=<an intact checkpoint folder>, start "
        f"over with checkpoint.resume=never (this run's outputs are moved to "
        f"{run_dir}/previous/<n>, nothing is deleted), or use a new run_dir."
    )


def _latest_notes(run_dir: Path, chosen: Path) -> list[str]:
    """What is wrong with ``latest.json`` when it does not name ``chosen``."""
    latest = checkpoint_root(run_dir) / LATEST
    if not latest.is_file():
        return [f"{latest} is missing"]
    try:
        named = json.loads(latest.read_text())["path"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{latest} is damaged ({type(e).__name__}: {e})"]
    if named != chosen.name:
        return [f"{latest} names {named}, not the newest intact checkpoint {chosen.name}"]
    return []


def check_checkpoint(folder: Path) -> None:
    """Raise :class:`CheckpointError` naming the file unless ``folder`` is a complete checkpoint
    whose files match their sizes and sha256 in its manifest."""
    try:
        verify_manifest(folder)
    except DamagedFolderError as e:
        raise CheckpointError(str(e)) from e
    if not (folder / CHECKPOINT_STATE).is_file():
        raise CheckpointError(
            f"{folder / CHECKPOINT_STATE} is missing: {folder} is not a training checkpoint"
        )


def prepare_checkpoint_folder(run_dir: str | Path, point: ResumePoint) -> list[str]:
    """Before a resume from ``point`` (rank 0 only): move the skipped step folders to
    ``set_aside/`` (so they are never overwritten, pruned or deleted) and point
    ``latest.json`` at the newest remaining folder. Returns what was done, to print."""
    root = checkpoint_root(run_dir)
    done = []
    for folder, why in point.skipped.items():
        aside = root / SET_ASIDE / folder.name
        dest = first_free(
            itertools.chain(
                [aside], (aside.with_name(f"{folder.name}.{n}") for n in itertools.count(1))
            )
        )
        dest.parent.mkdir(exist_ok=True)
        os.replace(folder, dest)
        done.append(f"checkpoint {folder} not resumed: {why}; moved to {dest}")
    remaining = step_folders(root)
    if remaining:
        write_json_atomic(
            root / LATEST, {"step": _step_of(remaining[0]), "path": remaining[0].name}
        )
    elif (root / LATEST).exists():
        (root / LATEST).unlink()
    return done


def _read(path: Path, load: Callable[[str], Any]) -> Any:
    """``load(path)``, with any failure reported as a :class:`CheckpointError` naming the file."""
    try:
        return load(str(path))
    except Exception as e:
        raise CheckpointError(
            f"{path} cannot be read ({type(e).__name__}: {e}); "
            f"resume from another checkpoint (checkpoint.resume=<folder>)"
        ) from e


def slot_snapshot(model: ModelOrChunks, slot: int, opt: SlotOptimizer) -> dict[str, Any]:
    """One slot's adapter and optimizer as full tensors (``tensors``: ``param/``, the fp32
    master weights, and the moments) and its metadata (collective: gathers every shard)."""
    # The fp32 master weights: a bf16 slot resumes from them, not from their rounding.
    tensors = {
        f"param/{k}": v for k, v in get_slot_tensors(model, slot, value=opt.master_of).items()
    }
    for moment in MOMENTS:
        tensors.update(
            {
                f"{moment}/{k}": v
                for k, v in get_slot_tensors(
                    model, slot, value=lambda p, m=moment: opt.state_of(p, m)
                ).items()
            }
        )
    layer = multi_lora_modules(model)[0].adapters[slot]
    return {
        "tensors": tensors,
        "rank": int(layer.rank),
        "alpha": float(layer.alpha),
        "dropout": float(layer.dropout),
        "optimizer": opt.scalar_state(),
    }


def restore_slot(
    model: ModelOrChunks,
    slot: int,
    meta: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    opt: SlotOptimizer,
    optimizer: bool = True,
) -> None:
    """Put a :func:`slot_snapshot` (its metadata and tensors) into ``slot`` and ``opt``
    (the slot's fresh optimizer; its moments and step count too unless ``optimizer`` is
    false)."""
    part = {
        prefix: {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + "/")}
        for prefix in ("param", *MOMENTS)
    }
    set_slot_tensors(
        model, slot, part["param"], meta["rank"], meta["alpha"], dropout=meta["dropout"]
    )
    fp32 = {}  # prefix -> {param: this rank's shard, fp32}
    for prefix in ("param", *MOMENTS):
        store: dict = {}
        set_slot_tensors(
            model,
            slot,
            part[prefix],
            meta["rank"],
            meta["alpha"],
            into=lambda p, store=store: store.setdefault(
                p, torch.zeros_like(p, dtype=torch.float32)
            ),
        )
        fp32[prefix] = store
    scalar = meta["optimizer"] if optimizer else {**meta["optimizer"], "adam_step": 0.0}
    opt.load(scalar, {m: fp32[m] for m in MOMENTS}, masters=fp32["param"])


def read_training_state(path: Path) -> dict[str, Any]:
    """A checkpoint's ``state.pt``: step, trainer state (e.g. the job queue), slot metadata."""
    return _read(path / CHECKPOINT_STATE, lambda f: torch.load(f, weights_only=False))


def saved_jobs(saved: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """A checkpoint's training jobs: name -> (its file, its metadata). Checkpoints of earlier
    versions kept them by slot (``slot<k>.safetensors``), named by the queue's slots."""
    if "jobs" in saved:
        return {name: (job_file(name), meta) for name, meta in saved["jobs"].items()}
    names = {p["slot"]: p["name"] for p in saved["trainer"]["queue"] if p["status"] == "active"}
    return {names[k]: (f"slot{k}.safetensors", meta) for k, meta in saved["slots"].items()}


def read_job_file(path: Path, name: str) -> dict[str, torch.Tensor]:
    return _read(path / name, load_file)


def restore_rng(path: Path, saved: dict[str, Any]) -> None:
    """The checkpoint's RNG streams, with the same world size (per rank)."""
    if saved["world_size"] == dist.get_world_size():
        restore_rng_state(
            _read(path / "rng.pt", lambda f: torch.load(f, weights_only=False))[dist.get_rank()]
        )


def rng_state() -> dict[str, Any]:
    """This rank's generators: the CPU one, megatron's tracker streams and, on a GPU, the
    current device's default CUDA generator (LoRA and attention dropout on replicated
    values draw from it)."""
    return {
        "cpu": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`rng_state` captured (the CUDA generator where both runs had one)."""
    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def checkpoint_adapter(folder: Path, job: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The adapter of ``job``, training when ``folder`` was saved: its full tensors (the fp32
    master weights) and its meta (``base_model``, ``dropout``, HF names), with ``rank`` and
    ``alpha`` added. Raises CheckpointError naming what is missing."""
    check_checkpoint(folder)
    state = read_training_state(folder)
    jobs = saved_jobs(state)
    if job not in jobs:
        names = ", ".join(sorted(jobs)) or "none"
        raise CheckpointError(
            f"job {job!r} was not training in {folder} (training then: {names}); "
            "finished jobs are exported under <run_dir>/adapters/"
        )
    if job not in state["trainer"].get("adapters", {}):
        raise CheckpointError(
            f"{folder} does not record its jobs' base model (a checkpoint from "
            "an older version): export the job from a newer checkpoint"
        )
    file, meta = jobs[job]
    tensors = read_job_file(folder, file)
    params = {k[len("param/") :]: v for k, v in tensors.items() if k.startswith("param/")}
    return params, {
        **state["trainer"]["adapters"][job],
        "rank": meta["rank"],
        "alpha": meta["alpha"],
    }

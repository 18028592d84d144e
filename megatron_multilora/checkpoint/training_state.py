"""Training checkpoints: adapters, per-slot optimizer and schedule, the job queue (with each
job's data position) and RNG, written atomically.

Adapter weights and Adam moments are stored as full, layout-independent tensors (gathered
from every TP/EP shard), so a run resumes under another TP/EP layout too; RNG streams are
per rank and are restored only when the world size matches.

Layout of ``<run_dir>/checkpoints/``: ``step_00000040/`` folders (``state.pt`` with the queue,
slots and scalar optimizer state, ``slot<k>.safetensors`` with ``param/``, ``exp_avg/``,
``exp_avg_sq/`` tensors, ``rng.pt``), and ``latest.json`` naming the newest complete one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from safetensors.torch import load_file, save_file

from megatron_multilora.checkpoint.adapter_tensors import gather_slot, load_slot
from megatron_multilora.platform.atomic_files import write_dir_atomic, write_json_atomic
from megatron_multilora.layers.lifecycle import ModelOrChunks, multi_lora_modules
from megatron_multilora.training.slot_optimizer import SlotOptimizer

MOMENTS = ("exp_avg", "exp_avg_sq")


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_training_checkpoint(run_dir: str | Path, step: int, model: ModelOrChunks,
                             optimizers: dict[int, SlotOptimizer], state: dict[str, Any],
                             keep_last: int) -> Path:
    """Save after ``step`` trainer steps (collective). ``state`` is picklable trainer state."""
    slots = {}
    for slot in sorted(optimizers):
        opt = optimizers[slot]
        tensors = {f"param/{k}": v for k, v in gather_slot(model, slot).items()}
        for moment in MOMENTS:
            tensors.update({f"{moment}/{k}": v for k, v in gather_slot(
                model, slot, value=lambda p, m=moment: opt.state_of(p, m)).items()})
        layer = multi_lora_modules(model)[0].adapters[slot]
        slots[slot] = {"tensors": tensors, "rank": int(layer.rank), "alpha": float(layer.alpha),
                       "dropout": float(layer.dropout), "optimizer": opt.scalar_state()}
    rng = [None] * dist.get_world_size()
    dist.all_gather_object(rng, {"cpu": torch.get_rng_state(),
                                 "tracker": get_cuda_rng_tracker().get_states()})
    root = checkpoint_root(run_dir)
    path = root / f"step_{step:08d}"
    if dist.get_rank() == 0:
        def fill(tmp: Path) -> None:
            meta = {k: {n: v for n, v in s.items() if n != "tensors"} for k, s in slots.items()}
            torch.save({"step": step, "slots": meta, "trainer": state,
                        "world_size": dist.get_world_size()}, tmp / "state.pt")
            for k, s in slots.items():
                save_file({n: t.contiguous() for n, t in s["tensors"].items()},
                          str(tmp / f"slot{k}.safetensors"))
            torch.save(rng, tmp / "rng.pt")
        write_dir_atomic(path, fill, overwrite=True)
        write_json_atomic(root / "latest.json", {"step": step, "path": path.name})
        for old in sorted(root.glob("step_*"))[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def find_checkpoint(run_dir: str | Path, resume: str) -> Optional[Path]:
    """The checkpoint to resume from: ``auto`` = the latest in run_dir (if any), ``never``,
    or an explicit checkpoint folder."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / "state.pt").is_file():
            raise FileNotFoundError(f"checkpoint.resume={resume}: not a checkpoint folder")
        return path
    latest = checkpoint_root(run_dir) / "latest.json"
    if not latest.is_file():
        return None
    return checkpoint_root(run_dir) / json.loads(latest.read_text())["path"]


def read_training_state(path: Path) -> dict[str, Any]:
    """A checkpoint's ``state.pt``: step, trainer state (e.g. the job queue), slot metadata."""
    return torch.load(path / "state.pt", weights_only=False)


def restore_training_checkpoint(path: Path, saved: dict[str, Any], model: ModelOrChunks,
                                make_optimizer: Callable[[int], SlotOptimizer]
                                ) -> dict[int, SlotOptimizer]:
    """Restore adapters, per-slot optimizers (``make_optimizer(slot)`` builds each) and,
    with the same world size, RNG; returns the optimizers by slot."""
    optimizers = {}
    for slot, meta in saved["slots"].items():
        tensors = load_file(str(path / f"slot{slot}.safetensors"))
        part = {prefix: {k[len(prefix) + 1:]: v for k, v in tensors.items()
                         if k.startswith(prefix + "/")} for prefix in ("param", *MOMENTS)}
        load_slot(model, slot, part["param"], meta["rank"], meta["alpha"],
                  dropout=meta["dropout"])
        opt = make_optimizer(slot)
        moments = {}
        for m in MOMENTS:
            store: dict = {}
            load_slot(model, slot, part[m], meta["rank"], meta["alpha"],
                      into=lambda p, store=store: store.setdefault(
                          p, torch.zeros_like(p, dtype=torch.float32)))
            moments[m] = store
        opt.load(meta["optimizer"], moments)
        optimizers[slot] = opt
    if saved["world_size"] == dist.get_world_size():
        rng = torch.load(path / "rng.pt", weights_only=False)[dist.get_rank()]
        torch.set_rng_state(rng["cpu"])
        get_cuda_rng_tracker().set_states(rng["tracker"])
    return optimizers

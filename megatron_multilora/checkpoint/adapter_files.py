"""The project's adapter folder: ``adapter_config.json`` + ``adapter.safetensors``.

Tensors are the full (unsharded) factors cut to the adapter's rank, keyed by layer path
(:mod:`megatron_multilora.layers.slot_tensors`), so an adapter saved under one TP/EP layout loads under any other
and into a slot of any max rank >= its rank. Only global rank 0 writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from megatron_multilora.atomic_files import write_dir_atomic
from megatron_multilora.checkpoint.adapter_folders import (
    ADAPTER_FORMAT,
    ADAPTER_TENSORS,
    CONFIG_FILE,
    FolderFormat,
    expect_format,
)
from megatron_multilora.checkpoint.files import refuse_existing
from megatron_multilora.layers.lifecycle import ModelOrChunks
from megatron_multilora.layers.slot_tensors import (
    get_slot_tensors,
    set_slot_tensors,
    slot_rank_alpha,
)


def export_adapter(
    model: ModelOrChunks,
    idx: int,
    out_dir: str | Path,
    meta: dict[str, Any],
    overwrite: bool = False,
) -> Path:
    """Write slot ``idx`` as an adapter folder (collective: every rank calls it)."""
    refuse_existing(out_dir, overwrite)
    tensors = get_slot_tensors(model, idx)
    rank, alpha = slot_rank_alpha(model, idx)
    if rank < 1 or alpha == 0.0:
        raise ValueError(f"slot {idx} holds no adapter (alpha={alpha}): nothing to export")
    config = {"format": ADAPTER_FORMAT, "version": 1, "rank": rank, "alpha": alpha, **meta}
    if dist.get_rank() == 0:

        def fill(tmp: Path) -> None:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / ADAPTER_TENSORS))
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))

        write_dir_atomic(out_dir, fill, overwrite=overwrite)
    dist.barrier()
    return Path(out_dir)


def read_adapter(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An adapter folder's config and tensors, with a clear error for anything else."""
    expect_format(folder, FolderFormat.ADAPTER)
    folder = Path(folder)
    return json.loads((folder / CONFIG_FILE).read_text()), load_file(str(folder / ADAPTER_TENSORS))


def import_adapter(model: ModelOrChunks, idx: int, folder: str | Path) -> dict[str, Any]:
    """Load an adapter folder into slot ``idx`` of this layout; returns its config."""
    config, tensors = read_adapter(folder)
    try:
        set_slot_tensors(model, idx, tensors, int(config["rank"]), float(config["alpha"]))
    except (KeyError, ValueError) as err:
        raise ValueError(f"{folder}: cannot load into this model: {err}") from None
    return config

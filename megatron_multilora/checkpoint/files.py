"""Checks around the atomic writes of :mod:`megatron_multilora.platform.atomic_files`."""

from __future__ import annotations

from pathlib import Path

import torch


def refuse_existing(path: str | Path, overwrite: bool) -> None:
    """Raise on every rank, before any of them writes, when ``path`` is a non-empty folder
    and ``overwrite`` is off (a check on one rank only would leave the others waiting)."""
    path = Path(path)
    exists = path.exists() and any(path.iterdir())
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # nobody writes before every rank has looked
    if exists and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty; pass overwrite to replace it")


"""Atomic writes: a reader sees the previous complete file or folder, or the new one."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch


def write_json_atomic(path: str | Path, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def refuse_existing(path: str | Path, overwrite: bool) -> None:
    """Raise on every rank, before any of them writes, when ``path`` is a non-empty folder
    and ``overwrite`` is off (a check on one rank only would leave the others waiting)."""
    path = Path(path)
    exists = path.exists() and any(path.iterdir())
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # nobody writes before every rank has looked
    if exists and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty; pass overwrite to replace it")


def write_dir_atomic(path: str | Path, fill: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Create folder ``path`` by ``fill(tmp_folder)`` then a rename; a crash in between
    leaves ``path`` as it was. An existing non-empty ``path`` needs ``overwrite``."""
    path = Path(path)
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty; pass overwrite to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        fill(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return path

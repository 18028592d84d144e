"""Atomic writes: a reader sees the previous complete file or folder, or the new one.

Folders can carry a manifest (every file's size and sha256, written last) so that damage
after the write is found on read; :func:`remove_write_leftovers` clears what killed writes
leave behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch


# Names of a write's temporary entries next to its target: ".<name>.tmp-<random>" while
# written, ".<name>.old-<pid>" for the folder being replaced.
_TMP, _OLD = ".tmp-", ".old-"
_LEFTOVER = re.compile(rf"\.(?P<target>.+?)(?P<kind>{re.escape(_TMP)}|{re.escape(_OLD)}).+")


def _temp_prefix(path: Path) -> str:
    return f".{path.name}{_TMP}"


def write_json_atomic(path: str | Path, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path))
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
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=_temp_prefix(path)))
    try:
        fill(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())
        if path.exists():
            old = path.with_name(f".{path.name}{_OLD}{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return path


def remove_write_leftovers(folder: str | Path) -> list[str]:
    """Delete the temporary files and folders that killed atomic writes left in ``folder``;
    returns their names. A replaced folder whose replacement never arrived (killed between
    the two renames) is put back instead."""
    folder = Path(folder)
    removed = []
    for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
        match = _LEFTOVER.fullmatch(entry.name)
        if match is None:
            continue
        target = folder / match["target"]
        if match["kind"] == _OLD and not target.exists():
            os.replace(entry, target)
            continue
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        removed.append(entry.name)
    return removed


MANIFEST = "manifest.json"


class DamagedFolderError(ValueError):
    """A folder's files do not match its manifest (or it has none): the message names the file."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: str | Path) -> None:
    """Record the size and sha256 of every file in ``folder`` in ``folder/manifest.json``.
    Call it last: a folder whose manifest verifies was completely written and is unchanged."""
    folder = Path(folder)
    files = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)}
             for f in sorted(folder.iterdir()) if f.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=2))


def verify_manifest(folder: str | Path) -> None:
    """Raise :class:`DamagedFolderError` naming the first file of ``folder`` that is missing,
    truncated or changed since :func:`write_manifest` (or the manifest itself)."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        raise DamagedFolderError(f"{manifest} is missing: the folder was not completely written")
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise DamagedFolderError(f"{manifest} is damaged (not a manifest: {e})") from e
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            raise DamagedFolderError(f"{path} is missing (listed in {MANIFEST})")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise DamagedFolderError(f"{path} has {size} bytes, {MANIFEST} says {want['bytes']} "
                                     f"(truncated or overwritten)")
        if _sha256(path) != want["sha256"]:
            raise DamagedFolderError(f"{path} is damaged: its sha256 differs from {MANIFEST}")

"""Checks around the atomic writes of :mod:`megatron_multilora.atomic_files`: refusing to
replace a folder, and a manifest (every file's size and sha256, written last) so that damage
after the write is found on read.
"""

from __future__ import annotations

import hashlib
import json
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


MANIFEST = "manifest.json"


class DamagedFolderError(ValueError):
    """A folder's files do not match its manifest (or it has none): the message names the file."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: str | Path, known: dict[str, dict] | None = None) -> None:
    """Record the size and sha256 of every file in ``folder`` in ``folder/manifest.json``
    (``known``: entries of files linked from a verified folder, not hashed again).
    Call it last: a folder whose manifest verifies was completely written and is unchanged."""
    folder, known = Path(folder), known or {}
    files = {
        f.name: known.get(f.name) or {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        for f in sorted(folder.iterdir())
        if f.name != MANIFEST
    }
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
            raise DamagedFolderError(
                f"{path} has {size} bytes, {MANIFEST} says {want['bytes']} "
                f"(truncated or overwritten)"
            )
        if _sha256(path) != want["sha256"]:
            raise DamagedFolderError(f"{path} is damaged: its sha256 differs from {MANIFEST}")


def manifest_entries(folder: str | Path) -> dict[str, dict]:
    """``folder``'s manifest: each file's size and sha256, by name."""
    return json.loads((Path(folder) / MANIFEST).read_text())["files"]

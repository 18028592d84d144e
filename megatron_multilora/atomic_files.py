"""Atomic writes: a reader sees the previous complete file or folder, or the new one.

Every writer in the package goes through these (checkpoints, adapter and PEFT folders, the
demo data and model, metrics, plots). Temporary names start with ``.<name>.`` beside the
target, so a rename stays on one filesystem and leftovers of a killed write are easy to spot.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

# Names of a write's temporary entries beside its target: ".<name>.tmp-<random>" while
# written, ".<name>.old-<pid>" for the folder being replaced.
_TMP, _OLD = ".tmp-", ".old-"
_LEFTOVER = re.compile(rf"\.(?P<target>.+?)(?P<kind>{re.escape(_TMP)}|{re.escape(_OLD)}).+")


def _temp_prefix(path: Path) -> str:
    return f".{path.name}{_TMP}"


@contextlib.contextmanager
def atomic_file(path: str | Path, binary: bool = False, exclusive: bool = False) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing (text is UTF-8); on a clean exit it
    is synced and renamed to ``path``, on an error removed, leaving ``path`` as it was.
    ``exclusive``: hard-link it to ``path`` instead, which raises FileExistsError when
    ``path`` exists (of racing writers of one name exactly one lands)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Opened normally (not mkstemp) so the file gets the usual umask permissions, not 0600.
    tmp = path.with_name(f"{_temp_prefix(path)}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "xb" if binary else "x", encoding=None if binary else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            os.link(tmp, path)
            tmp.unlink()
        else:
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, data: Any, exclusive: bool = False) -> None:
    with atomic_file(path, exclusive=exclusive) as f:
        json.dump(data, f, indent=2)


def write_dir_atomic(
    path: str | Path, fill: Callable[[Path], None], overwrite: bool = False
) -> Path:
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


def first_free(candidates: Iterable[Path]) -> Path:
    """The first of ``candidates`` that does not exist (e.g. ``previous/1``, ``previous/2``,
    ...), for moving something aside without overwriting what an earlier move left."""
    return next(path for path in candidates if not path.exists())

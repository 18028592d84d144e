"""The service's checkpoints: ``tinker://<client>/<kind>/<name>`` paths, each its owner's
(the API key's tenant) folder under ``<run_dir>/api/``, indexed in ``checkpoints.json`` so
that a restarted service finds them."""

from __future__ import annotations

import json
import shutil
import threading
from datetime import UTC, datetime
from pathlib import Path

from tinker import types

from megatron_multilora.api.request_checks import Refused
from megatron_multilora.atomic_files import write_json_atomic

INDEX = "checkpoints.json"


class CheckpointIndex:
    def __init__(self, root: Path) -> None:
        self.root, self.lock = root, threading.Lock()
        index = root / INDEX
        self.entries: dict[str, dict] = json.loads(index.read_text()) if index.is_file() else {}

    def __contains__(self, path: str) -> bool:
        return path in self.entries

    def get(self, owner: str, path: str, kind: str) -> dict:
        """The owner's checkpoint at ``path`` of ``kind`` (weights or sampler_weights)."""
        entry = self.entries.get(path)
        if entry is None or entry["owner"] != owner:
            raise Refused(404, f"no checkpoint {path!r} of this API key")
        if entry["kind"] != kind:
            raise Refused(400, f"{path} holds {entry['kind']}, not {kind}")
        return entry

    def place(self, owner: str, model_id: str, kind: str, name: str) -> tuple[str, str]:
        """The path and folder a client's checkpoint named ``name`` gets."""
        if not name or "/" in name or name.startswith("."):
            raise Refused(
                400, f"checkpoint name {name!r}: use letters, digits, '-', '_', '.' (no '/')"
            )
        path = f"tinker://{model_id}/{kind}/{name}"
        return path, str(self.root / owner / model_id.replace(":", "_") / kind / name)

    def add(
        self, path: str, owner: str, kind: str, folder: str, rank: int, user_metadata: dict | None
    ) -> None:
        """Index the owner's checkpoint (of ``kind``, in ``folder``), on disk at once; its
        client's rank and metadata come back in its training run's listing."""
        with self.lock:
            self.entries[path] = {
                "owner": owner,
                "kind": kind,
                "folder": folder,
                "rank": rank,
                "user_metadata": user_metadata,
                "time": datetime.now(UTC).isoformat(),
            }
            self._write()

    def remove(self, owner: str, path: str) -> None:
        """Delete the owner's checkpoint: its folder, then its entry."""
        with self.lock:
            entry = self.entries.get(path)
            if entry is None or entry["owner"] != owner:
                raise Refused(404, f"no checkpoint {path!r} of this API key")
            shutil.rmtree(entry["folder"], ignore_errors=True)
            del self.entries[path]
            self._write()

    def owned(self, owner: str, model_id: str | None = None) -> list[types.Checkpoint]:
        """The owner's checkpoints (of one training client, if given), oldest first."""
        with self.lock:
            found = [
                (path, entry)
                for path, entry in self.entries.items()
                if entry["owner"] == owner
                and (model_id is None or path.startswith(f"tinker://{model_id}/"))
            ]
        return sorted((_checkpoint(path, entry) for path, entry in found), key=lambda c: c.time)

    def run_info(self, model_id: str) -> dict:
        """A training client's rank and user metadata, as its last checkpoint recorded them."""
        with self.lock:
            mine = [e for p, e in self.entries.items() if p.startswith(f"tinker://{model_id}/")]
        last = max(mine, key=lambda e: e.get("time", ""), default={})
        return {"rank": last.get("rank"), "user_metadata": last.get("user_metadata")}

    def _write(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.root / INDEX, self.entries)


def _checkpoint(path: str, entry: dict) -> types.Checkpoint:
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)
    folder = Path(entry["folder"])
    size = (
        sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else None
    )
    return types.Checkpoint(
        checkpoint_id=parsed.checkpoint_id,
        checkpoint_type=parsed.checkpoint_type,
        tinker_path=path,
        time=entry.get("time") or datetime.fromtimestamp(0, UTC),
        size_bytes=size,
        user_metadata=entry.get("user_metadata"),
    )

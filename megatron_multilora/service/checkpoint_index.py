"""The service's checkpoints: ``tinker://<client>/<kind>/<name>`` paths, each its owner's
(the API key's tenant) folder under ``<run_dir>/api/``, indexed in ``checkpoints.json`` so
that a restarted service finds them."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from megatron_multilora.atomic_files import write_json_atomic
from megatron_multilora.service.requests import Refused

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
            raise Refused(400, f"checkpoint name {name!r}: use letters, digits, '-', '_', '.' "
                               "(no '/')")
        path = f"tinker://{model_id}/{kind}/{name}"
        return path, str(self.root / owner / model_id.replace(":", "_") / kind / name)

    def add(self, path: str, entry: dict) -> None:
        """Index a checkpoint (``owner``, ``kind``, ``folder``), on disk at once."""
        with self.lock:
            self.entries[path] = entry
            self.root.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.root / INDEX, self.entries)

"""The service's checkpoints: ``tinker://<client>/<kind>/<name>`` paths, each its owner's
(the API key's tenant) folder under ``<run_dir>/api/``, indexed in ``checkpoints.json`` so
that a restarted service finds them.

A checkpoint is indexed when its save is queued (so a name is taken at once) but listed,
usable and written to the index file only once the engine has written it (:meth:`settle`);
one saved with ``ttl_seconds`` expires then (listed with its ``expires_at`` until it does).
A key keeps at most ``max_saves`` checkpoints; the sampler weights that
``save_weights_and_get_sampling_client`` makes (``ephemeral``) do not count: they go with
their session, and a key keeps the last ``MAX_EPHEMERAL`` of them.
"""

from __future__ import annotations

import json
import shutil
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

from tinker import types

from megatron_multilora.api.request_checks import Refused
from megatron_multilora.atomic_files import write_json_atomic

INDEX = "checkpoints.json"
MAX_EPHEMERAL = 8  # a key's sampler weights of save_weights_and_get_sampling_client
MAX_NAME = 200  # a checkpoint name's bytes (a folder name: the filesystem takes 255)


class CheckpointIndex:
    def __init__(self, root: Path, max_saves: int = 1000) -> None:
        self.root, self.lock, self.max_saves = root, threading.Lock(), max_saves
        index = root / INDEX
        self.entries: dict[str, dict] = json.loads(index.read_text()) if index.is_file() else {}
        self.pending: dict[str, str] = {}  # request id -> the path its save writes

    def __contains__(self, path: str) -> bool:
        return path in self.entries

    def get(self, owner: str, path: str, kind: str, pending: bool = False) -> dict:
        """The owner's checkpoint at ``path`` of ``kind`` (weights or sampler_weights);
        ``pending``: also one still being written (for a call queued after its save)."""
        entry = self.entries.get(path)
        if entry is None or entry["owner"] != owner or _expired(entry):
            raise Refused(404, f"no checkpoint {path!r} of this API key")
        if entry["kind"] != kind:
            raise Refused(400, f"{path} holds {entry['kind']}, not {kind}")
        if entry.get("pending") and not pending:
            raise Refused(409, f"{path} is still being written: wait for its save's result")
        return entry

    def check_room(self, owner: str) -> None:
        """Refuse a save beyond the key's ``max_saves`` checkpoints."""
        with self.lock:
            held = sum(
                1 for e in self.entries.values() if e["owner"] == owner and not e.get("ephemeral")
            )
        if held >= self.max_saves:
            raise Refused(
                400,
                f"this API key keeps {held} checkpoints, the most it may (api.max_saves): "
                "delete some (RestClient.delete_checkpoint) or save with ttl_seconds",
            )

    def place(self, owner: str, model_id: str, kind: str, name: str) -> tuple[str, str]:
        """The path and folder a client's checkpoint named ``name`` gets: a name the
        filesystem takes as one folder (no '/', no leading '.', no control characters such
        as NUL, at most ``MAX_NAME`` bytes), refused at the front otherwise."""
        problem = _name_problem(name)
        if problem is not None:
            shown = name if len(name) <= 40 else f"{name[:40]}..."
            raise Refused(400, f"checkpoint name {shown!r}: {problem}")
        path = f"tinker://{model_id}/{kind}/{name}"
        return path, str(self.root / owner / model_id.replace(":", "_") / kind / name)

    def add(
        self,
        path: str,
        owner: str,
        kind: str,
        folder: str,
        client: tuple[int, dict | None],
        request_id: str,
        ttl_seconds: int | None = None,
        ephemeral: bool = False,
    ) -> list[str]:
        """Index the owner's checkpoint (of ``kind``, in ``folder``) that the call
        ``request_id`` writes; its client's rank and metadata (``client``) come back in its
        training run's listing. The folders of the key's ephemeral sampler weights beyond
        ``MAX_EPHEMERAL`` leave the index: the caller frees them."""
        now = datetime.now(UTC)
        with self.lock:
            self.entries[path] = {
                "owner": owner,
                "kind": kind,
                "folder": folder,
                "rank": client[0],
                "user_metadata": client[1],
                "time": now.isoformat(),
                "pending": request_id,
                **({"ephemeral": True} if ephemeral else {}),
                **(
                    {"expires_at": (now + timedelta(seconds=ttl_seconds)).isoformat()}
                    if ttl_seconds
                    else {}
                ),
            }
            self.pending[request_id] = path
            if not ephemeral:
                return []
            done = [
                p
                for p, e in self.entries.items()
                if e["owner"] == owner and e.get("ephemeral") and not e.get("pending")
            ]
            return self._forget(done[: max(0, len(done) - MAX_EPHEMERAL + 1)])

    def forget_ephemeral(self, folders: set[str]) -> None:
        """Their session has ended: these ephemeral sampler weights leave the index."""
        with self.lock:
            self._forget(
                [
                    p
                    for p, e in self.entries.items()
                    if e.get("ephemeral") and e["folder"] in folders
                ]
            )

    def _forget(self, paths: list[str]) -> list[str]:
        """(Holding the lock.) The entries leave the index; their folders."""
        folders = [self.entries.pop(p)["folder"] for p in paths]
        if paths:
            self._write()
        return folders

    def settle(self, request_id: str, written: bool) -> None:
        """The call ``request_id`` has run: its checkpoint is listed (``written``) or goes."""
        with self.lock:
            path = self.pending.pop(request_id, None)
            if path not in self.entries or self.entries[path].get("pending") != request_id:
                return
            if written:
                del self.entries[path]["pending"]
            else:
                shutil.rmtree(self.entries.pop(path)["folder"], ignore_errors=True)
            self._write()

    def expire(self) -> None:
        """Delete the checkpoints whose ``ttl_seconds`` have passed."""
        with self.lock:
            gone = [p for p, e in self.entries.items() if _expired(e) and not e.get("pending")]
            for path in gone:
                shutil.rmtree(self.entries.pop(path)["folder"], ignore_errors=True)
            if gone:
                self._write()

    def remove(self, owner: str, path: str) -> None:
        """Delete the owner's checkpoint: its folder, then its entry."""
        with self.lock:
            entry = self.entries.get(path)
            if entry is None or entry["owner"] != owner:
                raise Refused(404, f"no checkpoint {path!r} of this API key")
            if entry.get("pending"):
                raise Refused(409, f"{path} is still being written: delete it once it is saved")
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
                and not entry.get("pending")
                and not _expired(entry)
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
        """(Holding the lock.) The written checkpoints, on disk."""
        self.root.mkdir(parents=True, exist_ok=True)
        written = {p: e for p, e in self.entries.items() if not e.get("pending")}
        write_json_atomic(self.root / INDEX, written)


def _name_problem(name: str) -> str | None:
    if not name or "/" in name or name.startswith("."):
        return "use letters, digits, '-', '_', '.' (no '/', not starting with '.')"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "control characters (such as NUL) are not allowed"
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME:
        return f"{size} bytes: names of up to {MAX_NAME} bytes"
    return None


def _expired(entry: dict) -> bool:
    expires = entry.get("expires_at")
    return expires is not None and datetime.fromisoformat(expires) <= datetime.now(UTC)


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
        expires_at=entry.get("expires_at"),
    )

"""Results of the service's asynchronous calls, by request id: the engine completes them
(from its thread), the HTTP front long-polls them (``retrieve_future``)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import threading
import time
from typing import Any

JSON, PROTOBUF, ERROR = "json", "protobuf", "error"
KEEP_S = 600.0  # how long a result stays after it is done (the SDK may fetch it again)


@dataclasses.dataclass
class Result:
    kind: str  # JSON (a dict), PROTOBUF (bytes) or ERROR ((message, category))
    payload: Any


class Futures:
    """Request ids with an owner (the API key's tenant) and, once done, a result, kept
    ``KEEP_S`` seconds (the SDK may fetch one more than once); then forgotten, so that a
    long-running service does not grow. All results together keep at most ``max_bytes`` (their
    payloads' sizes): past it the oldest go first."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_bytes: int = 256 << 20) -> None:
        self.loop, self.max_bytes = loop, max_bytes
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._owner: dict[str, str] = {}
        self._done: dict[str, asyncio.Event] = {}
        self._results: dict[str, Result] = {}
        self._done_at: dict[str, float] = {}  # in completion order
        self._size: dict[str, int] = {}  # a kept result's payload bytes
        self.kept_bytes = 0

    def new(self, owner: str) -> str:
        """A fresh request id (call on the HTTP front's event loop)."""
        with self._lock:
            self._forget_old()
            request_id = f"req-{next(self._ids)}"
            self._owner[request_id] = owner
            self._done[request_id] = asyncio.Event()
        return request_id

    def complete(self, request_id: str, result: Result) -> None:
        """Set a result (from any thread)."""
        size = payload_bytes(result)
        with self._lock:
            self._results[request_id] = result
            self._done_at[request_id] = time.monotonic()
            self._size[request_id] = size
            self.kept_bytes += size
            event = self._done[request_id]
            self._forget_old()
        self.loop.call_soon_threadsafe(event.set)

    def owner(self, request_id: str) -> str | None:
        with self._lock:
            return self._owner.get(request_id)

    async def wait(self, request_id: str, timeout: float) -> Result | None:
        """The result, or None when it is not ready within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._done[request_id].wait(), timeout)
        except (TimeoutError, KeyError):
            return None
        with self._lock:
            return self._results.get(request_id)

    def kept(self) -> dict[str, list[int]]:
        """Per owner: [calls waiting for their result, results kept, their bytes]."""
        out: dict[str, list[int]] = {}
        with self._lock:
            for request_id, owner in self._owner.items():
                row = out.setdefault(owner, [0, 0, 0])
                if request_id in self._results:
                    row[1] += 1
                    row[2] += self._size[request_id]
                else:
                    row[0] += 1
        return out

    def _forget_old(self) -> None:
        """(Holding the lock.) Drop the results done more than ``KEEP_S`` ago, and the oldest
        while they hold more than ``max_bytes``."""
        now = time.monotonic()
        for request_id, done_at in list(self._done_at.items()):
            if now - done_at < KEEP_S and self.kept_bytes <= self.max_bytes:
                break
            del self._done_at[request_id], self._results[request_id]
            del self._owner[request_id], self._done[request_id]
            self.kept_bytes -= self._size.pop(request_id)


def payload_bytes(result: Result) -> int:
    """A result's size as kept: protobuf bytes, a JSON answer's or an error's text."""
    if isinstance(result.payload, bytes | bytearray):
        return len(result.payload)
    return len(json.dumps(result.payload, default=str))

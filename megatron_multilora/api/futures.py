"""Results of the service's asynchronous calls, by request id: the engine completes them
(from its thread), the HTTP front long-polls them (``retrieve_future``)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
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
    long-running service does not grow."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._owner: dict[str, str] = {}
        self._done: dict[str, asyncio.Event] = {}
        self._results: dict[str, Result] = {}
        self._done_at: dict[str, float] = {}  # in completion order

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
        with self._lock:
            self._results[request_id] = result
            self._done_at[request_id] = time.monotonic()
            event = self._done[request_id]
        self.loop.call_soon_threadsafe(event.set)

    def owner(self, request_id: str) -> str | None:
        with self._lock:
            return self._owner.get(request_id)

    async def wait(self, request_id: str, timeout: float) -> Result | None:
        """The result, or None when it is not ready within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._done[request_id].wait(), timeout)
        except TimeoutError:
            return None
        with self._lock:
            return self._results[request_id]

    def _forget_old(self) -> None:
        """(Holding the lock.) Drop the results done more than ``KEEP_S`` ago."""
        now = time.monotonic()
        for request_id, done_at in list(self._done_at.items()):
            if now - done_at < KEEP_S:
                break
            del self._done_at[request_id], self._results[request_id]
            del self._owner[request_id], self._done[request_id]

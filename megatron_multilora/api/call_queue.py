"""Calls waiting for the engine, in each client's order.

A training client's calls carry the SDK's ``seq_id`` (1, 2, ... over all its calls): the
queue hands out a client's call only when every earlier one has been handed out, at most
one per client per batch, so a client's calls apply in its order while different clients'
calls share a batch. Other calls (creations, samples) wait in arrival order. A bounded
number of calls may wait (beyond it the front answers 429, the SDK's backpressure).
"""

from __future__ import annotations

import threading
import time

from megatron_multilora.api.ops import Op


class CallQueue:
    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self._cond = threading.Condition()
        self._ordered: dict[str, dict[int, Op]] = {}  # client -> seq_id -> call
        self._expected: dict[str, int] = {}  # client -> the seq_id it runs next
        self._unordered: list[Op] = []
        self._pending = 0
        self._in_step: set[str] = set()  # the training clients of the last batch

    def put(
        self, op: Op, client: str | None = None, seq_id: int | None = None, force: bool = False
    ) -> bool:
        """Queue ``op`` (False: the queue is full; ``force``: queued anyway)."""
        with self._cond:
            if self._pending >= self.max_pending and not force:
                return False
            if client is None:
                self._unordered.append(op)
            else:
                self._ordered.setdefault(client, {})[seq_id] = op
            self._pending += 1
            self._cond.notify_all()
        return True

    def start(self, client: str, first_seq_id: int = 1) -> None:
        """A new training client: its calls run from ``first_seq_id`` on."""
        with self._cond:
            self._expected[client] = first_seq_id

    def forget(self, client: str) -> None:
        with self._cond:
            self._pending -= len(self._ordered.pop(client, {}))
            self._expected.pop(client, None)
            self._in_step.discard(client)

    def take(self, timeout: float, window: float) -> list[Op]:
        """The calls ready to run (empty after ``timeout`` seconds without any). Once one is
        ready, up to ``window`` seconds more for the next calls of the training clients of
        the last batch to join it: clients calling at once fall into step (a batch each
        round), while a lone client never waits."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            until = time.monotonic() + window
            while self._awaited() and (left := until - time.monotonic()) > 0:
                self._cond.wait(left)
            batch, self._in_step = self._ready(), set()
            for client, queue in self._ordered.items():
                if self._expected.get(client) in queue:
                    queue.pop(self._expected[client])
                    self._expected[client] += 1
                    self._in_step.add(client)
            self._unordered = []
            self._pending -= len(batch)
        return batch

    def _awaited(self) -> set[str]:
        """The last batch's training clients without a call ready now."""
        return {
            client
            for client in self._in_step
            if client in self._expected
            and self._expected[client] not in self._ordered.get(client, {})
        }

    def _ready(self) -> list[Op]:
        ordered = [
            queue[self._expected[client]]
            for client, queue in self._ordered.items()
            if client in self._expected and self._expected[client] in queue
        ]
        return ordered + list(self._unordered)

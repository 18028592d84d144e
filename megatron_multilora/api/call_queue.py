"""Calls waiting for the engine, in each client's order.

A training client's calls carry the SDK's ``seq_id`` (1, 2, ... over all its calls): the
queue hands out a client's call only when every earlier one has been handed out, at most
one per client per batch, so a client's calls apply in its order while different clients'
calls share a batch. Other calls (creations, samples) wait in arrival order. A bounded
number of calls may wait, and each API key only its share of them (beyond it the front
answers 429, the SDK's backpressure); a client's call may run at most ``MAX_AHEAD`` calls
ahead of its next one and never behind it (:meth:`CallQueue.refusal`), so no key can fill
the queue with calls that never run and every key's call waits at most one step.
"""

from __future__ import annotations

import threading
import time

from megatron_multilora.api.calls import Op

MAX_AHEAD = 64  # how far past its next call a client's call may be queued


class CallQueue:
    def __init__(self, max_pending: int, keys: int = 1) -> None:
        """``keys``: how many API keys share the queue (each may hold its share)."""
        self.max_pending = max_pending
        self.share = max(1, max_pending // max(keys, 1))
        self._owners: dict[str, int] = {}  # key (tenant) -> its calls waiting
        self._owner_of: dict[str, str] = {}  # request id -> its key
        self._cond = threading.Condition()
        self._ordered: dict[str, dict[int, Op]] = {}  # client -> seq_id -> call
        self._expected: dict[str, int] = {}  # client -> the seq_id it runs next
        self._unordered: list[Op] = []
        self._pending = 0
        self._in_step: set[str] = set()  # the training clients of the last batch
        self._sampled: set[str] = set()  # the keys with other calls (samples) in it

    @property
    def waiting(self) -> int:
        """Calls queued and not yet taken by the engine."""
        with self._cond:
            return self._pending

    def waiting_of(self, owner: str) -> int:
        """The key's calls queued and not yet taken."""
        with self._cond:
            return self._owners.get(owner, 0)

    def refusal(
        self, owner: str, client: str | None = None, seq_id: int | None = None, skip: bool = False
    ) -> tuple[int, str] | None:
        """Why a call of ``owner`` (the client's ``seq_id``-th) cannot be queued now: its
        HTTP status and message; None: it can. A ``skip`` (a refused call's place in its
        client's order) is checked for its order only."""
        with self._cond:
            expected = self._expected.get(client) if client is not None else None
            if expected is not None and seq_id is not None:
                if seq_id < expected or seq_id in self._ordered.get(client, {}):
                    return 400, (
                        f"seq_id {seq_id} of {client} has been queued already (its next "
                        f"call is {expected}): resend a call with its own seq_id"
                    )
                if seq_id >= expected + MAX_AHEAD:
                    return 400, (
                        f"seq_id {seq_id} of {client} is {seq_id - expected} calls ahead of "
                        f"its next call ({expected}); at most {MAX_AHEAD} may wait"
                    )
            if skip:
                return None
            if self._owners.get(owner, 0) >= self.share:
                return 429, (
                    f"this API key has {self._owners[owner]} calls waiting, its share of the "
                    "queue (api.max_pending / keys): retry once they have run"
                )
            if self._pending >= self.max_pending:
                return 429, "the service has too many calls waiting; retry shortly"
        return None

    def put(
        self,
        op: Op,
        client: str | None = None,
        seq_id: int | None = None,
        force: bool = False,
        owner: str | None = None,
    ) -> bool:
        """Queue ``op`` of ``owner`` (False: the queue is full; ``force``: queued anyway)."""
        with self._cond:
            if self._pending >= self.max_pending and not force:
                return False
            if client is None:
                self._unordered.append(op)
            else:
                self._ordered.setdefault(client, {})[seq_id] = op
            self._pending += 1
            if owner is not None:
                self._owners[owner] = self._owners.get(owner, 0) + 1
                self._owner_of[op.request_id] = owner
            self._cond.notify_all()
        return True

    def _taken(self, ops: list[Op]) -> None:
        """(Holding the lock.) ``ops`` leave the queue."""
        self._pending -= len(ops)
        for op in ops:
            owner = self._owner_of.pop(op.request_id, None)
            if owner is not None:
                self._owners[owner] -= 1
                if not self._owners[owner]:
                    del self._owners[owner]

    def start(self, client: str, first_seq_id: int = 1) -> None:
        """A new training client: its calls run from ``first_seq_id`` on."""
        with self._cond:
            self._expected[client] = first_seq_id

    def forget(self, client: str) -> None:
        with self._cond:
            self._taken(list(self._ordered.pop(client, {}).values()))
            self._expected.pop(client, None)
            self._in_step.discard(client)

    def take(self, timeout: float, window: float) -> list[Op]:
        """The calls ready to run (empty after ``timeout`` seconds without any). Once one is
        ready, up to ``window`` seconds more for the next calls of the training clients of
        the last batch to join it: clients calling at once fall into step (a batch each
        round), while a lone client never waits. Keys that sampled in the last batch are
        waited for the same way, so tenants' samples share a generation pass."""
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
            self._sampled = {self._owner_of.get(op.request_id) for op in self._unordered} - {None}
            for client, queue in self._ordered.items():
                if self._expected.get(client) in queue:
                    queue.pop(self._expected[client])
                    self._expected[client] += 1
                    self._in_step.add(client)
            self._unordered = []
            self._taken(batch)
        return batch

    def _awaited(self) -> set[str]:
        """The last batch's training clients without a call ready now, and the keys that
        sampled in it without any call ready now (a tenant's next samples join the others')."""
        waiting = {
            client
            for client in self._in_step
            if client in self._expected
            and self._expected[client] not in self._ordered.get(client, {})
        }
        ready = {self._owner_of.get(op.request_id) for op in self._ready()}
        return waiting | (self._sampled - ready)

    def _ready(self) -> list[Op]:
        ordered = [
            queue[self._expected[client]]
            for client, queue in self._ordered.items()
            if client in self._expected and self._expected[client] in queue
        ]
        return ordered + list(self._unordered)

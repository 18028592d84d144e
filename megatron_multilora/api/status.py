"""The service's ``status.json`` (the one ``mmlora status`` and ``mmlora stop`` read for a
trainer): its URL and model, the calls it ran, what paging clients' adapters cost, what it
keeps per tenant and in all (``memory.py``), and a row per training client (its device slot, None while paged out, optim steps and last loss). Rank 0 writes it at most once a second, and when it stops."""

from __future__ import annotations

import dataclasses
import os
import socket
import time

from megatron_multilora.api.engine import Engine
from megatron_multilora.api.front import Front
from megatron_multilora.api.heap import TRIM_EVERY_S, HeapSnapshots, trim_heap
from megatron_multilora.api.memory import service_memory
from megatron_multilora.training.jobs.states import ACTIVE, SERVING
from megatron_multilora.training.mailbox import folder


class ServiceStatus:
    def __init__(self, run_dir: str, url: str, front: Front, engine: Engine, dp_size: int) -> None:
        self.run_dir, self.front, self.engine = run_dir, front, engine
        self.about = {"url": url, "model": front.limits.model_name}
        self.dp_size, self.calls, self._written, self._trimmed = dp_size, 0, 0.0, 0.0
        self.snapshots = HeapSnapshots()

    def write(self, state: str = SERVING, force: bool = False) -> None:
        if not force and time.time() - self._written < 1.0:
            return
        self._written = time.time()
        memory = self.front.memory = service_memory(self.front, self.engine)
        self.snapshots.maybe_take()
        if time.time() - self._trimmed > TRIM_EVERY_S:
            self._trimmed = time.time()
            trim_heap()
        with self.front.lock:
            clients = sorted(self.front.clients.values(), key=lambda c: c.slot)
        rows = [
            {
                "name": c.model_id,
                "status": ACTIVE if state == SERVING else state,
                "slot": self.engine.table.slot_of(c.slot),  # None: paged to host memory
                "steps_done": self.engine.steps.get(c.slot, 0),
                "total_steps": None,
                "loss": self.engine.losses.get(c.slot),
                "source": "api",
            }
            for c in clients
        ]
        folder.write_status(
            self.run_dir,
            {
                "state": state,
                "step": self.calls,
                "updated_at": time.time(),
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "dp_size": self.dp_size,
                "service": self.about,
                "paging": dataclasses.asdict(self.engine.table.stats),
                "memory": memory,
                "jobs": rows,
            },
        )

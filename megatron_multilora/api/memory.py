"""What the training service keeps, per tenant (API key) and in all, each with its bound:
the results kept for the SDK to fetch, recorded samples, sessions, training clients and
their paged adapters, samplers, checkpoints, the resend window and the call queue. Taken by
rank 0's status writer between batches (the engine's thread: its structures are still), shown
by ``mmlora status`` and, in all only, by ``/healthz``.
"""

from __future__ import annotations

import os
from typing import Any

from megatron_multilora.api.engine import Engine
from megatron_multilora.api.front import RESEND_WINDOW, Front

# structure -> what bounds it (shown beside its size)
BOUNDS = {
    "results": "api.kept_results_mb, each result 10 minutes",
    "recorded_samples": "api.recorded_samples_mb; api.recorded_samples_per_session a session",
    "sessions": "api.max_sessions a key; silent ones end after api.session_timeout_s",
    "training_clients": "api.max_training_clients",
    "paged_adapters": "api.max_training_clients less lora.slots, within api.paged_adapters_mb",
    "samplers": "api.max_samplers a key, and its last 8 weights-and-sampler saves",
    "checkpoints": "api.max_saves a key",
    "resend_window": f"{RESEND_WINDOW} calls a training client",
    "queue": "api.max_pending (each key its share)",
}


def rss_mib() -> float | None:
    """This process's resident memory (Linux), MiB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def service_memory(front: Front, engine: Engine) -> dict[str, Any]:
    """``{"rss_mib", "in_all": {structure: {"count", "bytes"?, "bound"}}, "tenants": {key:
    {structure: count or [count, bytes]}}}``."""
    tenants = _by_tenant(front, engine)
    in_all: dict[str, dict[str, Any]] = {}
    for row in tenants.values():
        for what, value in row.items():
            total = in_all.setdefault(what, {"count": 0})
            if isinstance(value, list):
                total["count"] += value[0]
                total["bytes"] = total.get("bytes", 0) + value[1]
            else:
                total["count"] += value
    for what, bound in BOUNDS.items():
        in_all.setdefault(what, {"count": 0}).update(bound=bound)
    in_all["queue"]["count"] = front.calls.waiting  # a forced call may have no tenant
    in_all["training_clients"]["bound"] = (
        f"{front.limits.max_clients} ({front.limits.clients_bound})"
    )
    return {"rss_mib": rss_mib(), "in_all": in_all, "tenants": tenants}


def _by_tenant(front: Front, engine: Engine) -> dict[str, dict[str, Any]]:
    tenants: dict[str, dict[str, Any]] = {}

    def add(owner: str, what: str, count: int, nbytes: int | None = None) -> None:
        row = tenants.setdefault(owner, {})
        old = row.get(what, [0, 0] if nbytes is not None else 0)
        row[what] = [old[0] + count, old[1] + nbytes] if nbytes is not None else old + count

    for owner, (_, kept, nbytes) in front.futures.kept().items():
        add(owner, "results", kept, nbytes)
    with front.lock:
        session_owner = {sid: owner for sid, (owner, _) in front.sessions.items()}
        for owner in session_owner.values():
            add(owner, "sessions", 1)
        pages = engine.table.pages
        for client in front.clients.values():
            add(client.owner, "training_clients", 1)
            page = pages.get(client.slot)
            if page is not None:
                add(client.owner, "paged_adapters", 1, page.nbytes)
        for sampler in front.samplers.values():
            add(sampler.owner, "samplers", 1)
        seen = {}
        for (model_id, _), _ in front.seen.items():
            seen[model_id] = seen.get(model_id, 0) + 1
        for model_id, n in seen.items():
            client = front.clients.get(model_id)
            if client is not None:
                add(client.owner, "resend_window", n)
    with front.checkpoints.lock:
        for entry in front.checkpoints.entries.values():
            add(entry["owner"], "checkpoints", 1)
    for session, samples in engine.recorded.sessions.items():
        owner = session_owner.get(session, "(ended sessions)")
        add(owner, "recorded_samples", len(samples), engine.recorded.bytes.get(session, 0))
    for owner, row in tenants.items():
        row["queue"] = front.calls.waiting_of(owner)
    return tenants

"""Rows 16h-16i: the training service holding more tenants than device slots. One service
with 8 device slots serves 64 tinker SDK tenants (their adapters paged between the slots and
host memory) or 8 of them (each in a slot), side by side in one run: tokens trained per
second and the 95th percentile of a forward_backward call's latency at the client."""

from __future__ import annotations

import json
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.api_service import free_port, launch
from benchmarks.report import Row
from benchmarks.settings import Settings
from benchmarks.timing import Clock, medians, time_side_by_side

TENANTS, SLOTS = 64, 8
KEYS = [f"tml-page{i}" for i in range(8)]  # 8 tenants a key (each key its share of calls)
DATUMS, TOKENS = 2, 32


def service_paging(s: Settings, clock: Clock) -> dict:
    """Per variant ("64 tenants", "8 tenants"): each round's seconds, tokens trained per
    second and every forward_backward latency (s); and what paging cost in the service."""
    import tinker
    from tinker import types

    tmp = Path(tempfile.mkdtemp(prefix="bench-paging-"))
    port, log = free_port(), tmp / "service.log"
    clock.say(f"adapters: the service with {SLOTS} slots for {TENANTS} tenants: starting")
    extra = (f"api.max_training_clients={TENANTS}", "api.max_pending=1024")
    proc = launch(s, tmp / "run", port, log, slots=SLOTS, keys=KEYS, extra=extra)
    try:
        services = [
            tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=k) for k in KEYS
        ]
        clients = [
            services[i % len(KEYS)]
            .create_lora_training_client(base_model="tiny", rank=s.rank, seed=i)
            .result()
            for i in range(TENANTS)
        ]
        gen = torch.Generator().manual_seed(6)
        batches = [
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints(t[:-1]),
                    loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (TOKENS - 1)},
                )
                for t in torch.randint(3, 200, (DATUMS, TOKENS), generator=gen).tolist()
            ]
            for _ in clients
        ]
        adam = types.AdamParams(learning_rate=1e-4)
        latencies: dict[str, list[float]] = {}

        def tenant(i: int, into: list[float]) -> None:
            for _ in range(s.job_steps):
                start = time.perf_counter()
                clients[i].forward_backward(batches[i], "cross_entropy").result()
                into.append(time.perf_counter() - start)
                clients[i].optim_step(adam).result()

        def variant(n: int):
            def run() -> None:
                into = latencies.setdefault(f"{n} tenants", [])
                threads = [threading.Thread(target=tenant, args=(i, into)) for i in range(n)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()

            return run

        samples = time_side_by_side(
            clock,
            "adapters service",
            {f"{n} tenants": variant(n) for n in (TENANTS, SLOTS)},
            s.job_rounds,
            1,
        )
        time.sleep(1.5)  # the status is written at most once a second
        paging = json.loads((tmp / "run" / "serve" / "status.json").read_text())["paging"]
        for sc in services:
            sc.close("success").result()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    med = medians(samples)
    out = {}
    for n in (TENANTS, SLOTS):
        name = f"{n} tenants"
        tokens = n * s.job_steps * DATUMS * (TOKENS - 1)
        out[name] = {
            "seconds": med[name],
            "tokens_per_s": tokens / med[name],
            "p95_ms": 1e3 * statistics.quantiles(latencies[name], n=20)[-1],
        }
    out["paging"] = paging
    out["samples"] = samples
    return out


def service_paging_rows(s: Settings, measured: dict) -> list[Row]:
    many, few = measured[f"{TENANTS} tenants"], measured[f"{SLOTS} tenants"]
    paging = measured["paging"]
    moved = paging["pages_in"] + paging["pages_out"]
    what = (
        f"tinker SDK tenants (one thread each), each {s.job_steps} x (forward_backward of "
        f"{DATUMS} datums of {TOKENS} tokens + optim_step), rank {s.rank}, through one mmlora "
        f"api with {SLOTS} device slots on the dense GPT of rows 1c/2c: {TENANTS} tenants "
        f"(adapters paged) vs {SLOTS} (each in a slot), rounds alternating"
    )
    note = (
        f"{paging['pages_in']} adapters paged in and {paging['pages_out']} out in the whole run, "
        f"{(paging['bytes_in'] + paging['bytes_out']) / 2**20:.0f} MiB, "
        f"{1e3 * paging['seconds'] / max(1, moved):.2f} ms each"
    )
    return [
        Row(
            "16h",
            f"service throughput: {TENANTS} tenants over {SLOTS} slots vs {SLOTS} tenants",
            what + "; tokens trained per second",
            f"{TENANTS} tenants",
            f"{SLOTS} tenants",
            "tokens/s",
            note=note,
        ).fill(many["tokens_per_s"], few["tokens_per_s"]),
        Row(
            "16i",
            f"forward_backward p95 latency: {TENANTS} tenants over {SLOTS} slots vs {SLOTS}",
            what + "; the 95th percentile of a forward_backward call's time at the client",
            f"{TENANTS} tenants",
            f"{SLOTS} tenants",
            "ms",
            note=f"{TENANTS // SLOTS}x the tenants share the same slots and steps",
        ).fill(many["p95_ms"], few["p95_ms"]),
    ]

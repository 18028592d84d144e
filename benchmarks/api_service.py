"""Rows 12: the training service (``mmlora api``) with tinker SDK clients. 12a: 4 clients'
forward_backward + optim_step steps through one service at once (their calls batched into
shared steps) vs the same clients served one after another; 12b: what a call costs beyond
the engine's work (HTTP, protobuf/JSON, the future's polling), as a share of a call."""

from __future__ import annotations

import os
import re
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.report import Results, Row
from benchmarks.settings import REPO, Settings
from benchmarks.timing import Clock, medians, time_side_by_side

CLIENTS = 4
KEYS = [f"tml-bench{i}" for i in range(CLIENTS)]
ENGINE_MS = re.compile(r"api: ran \d+ calls \(([^)]*)\) in ([\d.]+) ms")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    s: Settings,
    run_dir: Path,
    port: int,
    log: Path,
    slots: int = CLIENTS,
    keys: list[str] = KEYS,
    extra: tuple[str, ...] = (),
) -> subprocess.Popen:
    """The service on the dense model of rows 1c/2c, one process, its default batching
    window (up to 20 ms for the last batch's clients; a lone client does not wait)."""
    cfg = [
        "hf_dir=null",
        f"lora.slots={slots}",
        f"lora.max_rank={s.rank}",
        f"model.hidden_size={s.model_hidden}",
        f"model.num_layers={s.model_layers}",
        f"model.ffn_hidden_size={2 * s.model_hidden}",
        "trainer.micro_batch_tokens=16384",
        *extra,
    ]
    return start_service(cfg, run_dir, port, log, keys, {"OMP_NUM_THREADS": str(s.threads)})


def start_service(
    overrides: list[str],
    run_dir: Path,
    port: int,
    log: Path,
    keys: list[str],
    env: dict[str, str] | None = None,
    timeout_s: float = 300,
) -> subprocess.Popen:
    """``mmlora api`` with ``overrides`` in a session of its own (the caller ends its whole
    process group), once it says it serves."""
    proc = subprocess.Popen(
        [str(REPO / ".venv/bin/mmlora"), "api", "--run-dir", str(run_dir), "--port", str(port)]
        + overrides,
        cwd=REPO,
        env={**os.environ, "MMLORA_API_KEYS": ",".join(keys), **(env or {})},
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    while "api: serving" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the service did not start: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    return proc


def section_api(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    import tinker

    if device.type != "cpu":
        out.rows.append(
            Row(
                "12a",
                "training service",
                "",
                "",
                "",
                "s",
                skipped="the service benchmark runs on CPU",
            )
        )
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-api-"))
    port, log = free_port(), tmp / "service.log"
    clock.say(f"api: starting the service ({CLIENTS} slots)")
    proc = launch(s, tmp / "run", port, log)
    try:
        services = [
            tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=k) for k in KEYS
        ]
        clients = [
            sc.create_lora_training_client(base_model="tiny", rank=s.rank, seed=i).result()
            for i, sc in enumerate(services)
        ]
        sizes = {"12a": (2 * s.examples_per_slot, s.example_tokens), "12c": (1, 16)}
        samples = {
            row: _at_once_vs_alone(s, clock, clients, *size, row) for row, size in sizes.items()
        }
        out.samples["api"] = samples["12a"]
        out.samples["api-small"] = samples["12c"]
        # 12b: one client alone, call by call: the engine's time (the service's log) vs the
        # client's.
        steps = _stepper(s, clients, *sizes["12a"])
        before = len(log.read_text())
        calls, start = 0, time.perf_counter()
        for _ in range(3):
            steps(0)
            calls += 2 * s.job_steps
        client_ms = (time.perf_counter() - start) * 1e3 / calls
        time.sleep(0.5)  # the last log line
        engine = [float(ms) for _, ms in ENGINE_MS.findall(log.read_text()[before:])]
        engine_ms = statistics.fmean(engine) if engine else float("nan")
        for sc in services:
            sc.close("success").result()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    for row_id, (n_datums, n) in sizes.items():
        med = medians(samples[row_id])
        row = Row(
            row_id,
            f"{CLIENTS} SDK clients' steps ({n_datums} x {n}-token datums): one "
            "batched service vs one client at a time",
            (
                f"{CLIENTS} tinker SDK clients (tinker 0.38.0, one thread each), each {s.job_steps} x "
                f"(forward_backward of {n_datums} datums of {n} tokens, cross_entropy + "
                f"optim_step), rank {s.rank}, through mmlora api on the dense GPT of rows 1c/2c (one "
                "process, the default api.batch_window_ms): all clients at once (their calls share steps) vs "
                "the same clients one after another"
            ),
            "at once",
            "one after another",
            "s",
        ).fill(med["at once"], med["one after another"])
        row.note = f"At once is {1 / row.ratio:.2f}x the throughput."
        out.rows.append(row)
    out.rows.append(
        Row(
            "12b",
            "service overhead per call (one client alone, the datums of 12a)",
            (
                "the client's time per call (forward_backward or optim_step) vs the engine's time to run "
                "it (the service's log)"
            ),
            "client",
            "engine",
            "ms",
        ).fill(client_ms, engine_ms)
    )
    out.rows[-1].note = (
        f"The service's own cost (HTTP, protobuf/JSON, polling the future) is "
        f"{100 * (1 - engine_ms / client_ms):.0f}% of a call."
    )


def _stepper(s: Settings, clients: list, n_datums: int, n: int):
    """``steps(i)``: client i's ``s.job_steps`` steps on its own random datums."""
    from tinker import types

    gen = torch.Generator().manual_seed(4)
    batches = [
        [
            types.Datum(
                model_input=types.ModelInput.from_ints(t[:-1]),
                loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0 / n] * (n - 1)},
            )
            for t in torch.randint(3, 200, (n_datums, n), generator=gen).tolist()
        ]
        for _ in clients
    ]
    adam = types.AdamParams(learning_rate=1e-4)

    def steps(i: int) -> None:
        for _ in range(s.job_steps):
            clients[i].forward_backward(batches[i], "cross_entropy").result()
            clients[i].optim_step(adam).result()

    return steps


def _at_once_vs_alone(
    s: Settings, clock: Clock, clients: list, n_datums: int, n: int, label: str
) -> dict[str, list[float]]:
    steps = _stepper(s, clients, n_datums, n)

    def together() -> None:
        threads = [threading.Thread(target=steps, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def alone() -> None:
        for i in range(len(clients)):
            steps(i)

    clock.say(
        f"api {label}: {len(clients)} clients x {s.job_steps} steps of {n_datums} x {n} "
        "tokens, at once vs one after another"
    )
    return time_side_by_side(
        clock, f"api {label}", {"at once": together, "one after another": alone}, s.job_rounds, 1
    )

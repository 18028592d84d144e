"""The service's run: the run's model (every rank), the HTTP front (rank 0, in a thread) and
the engine loop: rank 0 takes the ready calls from the call queue, every rank receives them
(one broadcast) and runs them, so calls run under any parallel layout as a step does.

    mmlora api --run-dir R --port P [OVERRIDE ...]   # the recipe with api.enabled=true
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from megatron_multilora.api.call_queue import CallQueue
from megatron_multilora.api.engine import Engine
from megatron_multilora.api.front import Front, Limits
from megatron_multilora.api.futures import Futures
from megatron_multilora.api.host_memory import available_host_bytes, held_clients
from megatron_multilora.api.routes import build_app
from megatron_multilora.api.status import ServiceStatus
from megatron_multilora.errors import RunError
from megatron_multilora.parallel import destroy_parallel
from megatron_multilora.training.config import RunConfig
from megatron_multilora.training.jobs.states import STOPPED
from megatron_multilora.training.mailbox import folder
from megatron_multilora.training.runtime import Runtime
from megatron_multilora.training.stop import received


def serve_api(run: RunConfig, keys: dict[str, str], say: Callable[[str], None] = print) -> None:
    """Serve until a stop signal or ``mmlora stop --run-dir``; ``keys``: the API keys
    (``api_keys.load_keys``, checked before the launch)."""
    runtime = Runtime.build(run)  # the layout, tokenizer, model and step, as the trainer's
    run_dir = Path(run.run_dir)
    hf_dir = str(Path(run.hf_dir).resolve()) if run.hf_dir else None
    front = None
    pages = [None] * dist.get_world_size()  # each rank's (host, page), as stages differ
    dist.all_gather_object(pages, (socket.gethostname(), runtime.table.page_bytes(True)))
    page = sum(b for host, b in pages if host == pages[0][0])  # a client's, on rank 0's host
    if dist.get_rank() == 0:
        clients = _held_clients(run, page, say)
        front, url = _start_front(run, keys, runtime.model_config, hf_dir, run_dir, say, clients)
    engine = Engine(runtime, run_dir, hf_dir, front.answer if front else None)
    status = None
    if front:
        dp = runtime.dp_size
        status = ServiceStatus(run.run_dir, url, front, engine, dp)
        status.write(force=True)
        say(
            f"api: serving {front.limits.model_name!r} ({run.lora.slots} adapter slots, up to "
            f"{front.limits.max_clients} training clients (those beyond the slots paged "
            f"to host memory, {page / 2**20:.1f} MiB each on this host), ranks "
            f"up to {run.lora.max_rank}, world {dist.get_world_size()}, data parallel {dp}) "
            f"at {url}"
        )
    window = run.api.batch_window_ms / 1000.0
    while True:
        message = [None]
        if front:
            stop = received() or folder.stop_requested(run.run_dir)
            front.sweep()
            message = [
                ("stop", None) if stop else ("run", front.calls.take(timeout=0.5, window=window))
            ]
            status.write()
        dist.broadcast_object_list(message, src=0)
        what, ops = message[0]
        if what == "stop":
            break
        if ops:
            start = time.perf_counter()
            engine.run(ops)
            if front:
                status.calls += len(ops)
                kinds = [op.kind for op in ops]
                say(
                    f"api: ran {len(ops)} calls ({', '.join(sorted(set(kinds)))}) in "
                    f"{(time.perf_counter() - start) * 1e3:.1f} ms; "
                    f"{kinds.count('forward_backward')} forward_backward in one step"
                )
    if front:
        status.write(STOPPED, force=True)
        folder.clear_stop_request(run.run_dir)
        say(
            "api: stopped (clients' saved states stay in the run folder; a restart on it "
            "serves them)"
        )
    destroy_parallel()


def _held_clients(run: RunConfig, page_bytes: int, say: Callable[[str], None]) -> int:
    """api.max_training_clients, or fewer where their pages (``page_bytes`` each: all of this
    host's ranks' parts) would not fit host memory."""
    clients, why = held_clients(
        run.api.max_training_clients,
        run.lora.slots,
        page_bytes,
        run.api.paged_adapters_mb,
        available_host_bytes(),
    )
    if why:
        say(f"api: {why}")
    return clients


def _byte_tokenizer_folder(run_dir: Path) -> str:
    """The built-in byte tokenizer (a model built from its config) as a Hugging Face folder,
    whose path ``get_info`` hands the SDK as the tokenizer id: ``get_tokenizer()`` then loads
    it offline instead of looking the model's name up on the Hub."""
    from megatron_multilora.models.tiny_hf import byte_level_tokenizer

    folder = run_dir / "api" / "tokenizer"
    byte_level_tokenizer().save_pretrained(folder)
    return str(folder.resolve())


def _start_front(
    run: RunConfig,
    keys: dict[str, str],
    model_config,
    hf_dir,
    run_dir: Path,
    say: Callable[[str], None],
    clients: int,
) -> tuple[Front, str]:
    import asyncio

    import uvicorn

    api = run.api
    name = api.model_name or (Path(run.hf_dir).name if run.hf_dir else "tiny")
    limits = Limits(
        name,
        model_config.vocab_size,
        run.trainer.max_seq_len,
        run.lora.slots,
        run.lora.max_rank,
        hf_dir or _byte_tokenizer_folder(run_dir),
        unembed="output_layer" in run.lora.targets,
        clients=clients,
        clients_bound="api.max_training_clients"
        if clients == api.max_training_clients
        else "api.paged_adapters_mb, host memory for paged clients",
    )
    loop = asyncio.new_event_loop()
    queue = CallQueue(api.max_pending, len(keys))
    front = Front(
        keys,
        limits,
        run_dir,
        queue,
        Futures(loop, int(api.kept_results_mb * 2**20)),
        api.session_timeout_s,
        api.max_saves,
        say,
        api.max_sessions,
        api.max_samplers,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(front), host=api.host, port=api.port, log_level="warning", loop="asyncio"
        )
    )

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.serve())

    thread = threading.Thread(target=serve, name="api-front", daemon=True)
    thread.start()
    # Started means listening; a bind that fails ends the thread (uvicorn logs why).
    for _ in range(600):
        if server.started:
            return front, f"http://{api.host}:{api.port}"
        if not thread.is_alive():
            break
        time.sleep(0.1)
    raise RunError(
        f"api: cannot listen on {api.host}:{api.port}: another service there? Choose another --port"
    )

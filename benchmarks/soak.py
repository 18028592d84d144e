"""Rows 17: the training service under a tenant load for ``--minutes`` (60 by default), its
memory sampled as it runs. Not a CI test: ``python -m benchmarks --only soak --minutes 60``.

The load, per tenant (tinker SDK, one thread each): a LoRA training client of rank 32 on
``mmlora api``'s defaults (conf/api.yaml: the output layer adapted, 2048-token sequences),
looping ``forward_backward`` (2 to 4 datums of random length), ``optim_step``, a ``sample``
from ``save_weights_and_get_sampling_client`` (recording its stability info every other
time), a ``save_state`` (kept 10 minutes), and hostile requests (a NUL and a 5,000-character
checkpoint name, a body that is not JSON) that must get 4xx; at the end a flood of polls for
results that do not exist. 8 tenants on the tiny base with datums up to 2047 tokens; 4 on
SmolLM2-135M (where data/smollm2-135m-instruct exists) with datums up to 511 tokens, so that a
2-core machine runs more than a few dozen of its calls an hour. The bases run at once.

Every ``minutes / 12`` of load (5 minutes of an hour) the tenants are held after their
current call, and once the service has been idle past a heap trim, the service's resident
memory is read (the launcher and its worker, summed over the process group) with each
structure the service accounts for (``status.json``'s ``memory``): memory at rest, what the
service keeps. It is read once at start too, serving, before any tenant. The peak while
loaded, sampled every 5 s, is printed beside it. Rows: RSS at rest at the end against at a
sixth of the run (10 minutes of an hour); the goal is within 5%.

The services inherit this process's environment: ``SOAK_BASES=tiny`` runs one base, and
``MMLORA_MALLOC_TRIM_S=0 MALLOC_ARENA_MAX=16`` (glibc's default on 2 cores) the baseline
without the service's allocator settings (``megatron_multilora/api/heap.py``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.api_service import free_port, start_service
from benchmarks.report import Results, Row
from benchmarks.settings import REPO, Settings
from benchmarks.timing import Clock
from megatron_multilora.api.heap import TRIM_EVERY_S
from megatron_multilora.training.mailbox.folder import read_status

SMOLLM2 = REPO / "data" / "smollm2-135m-instruct"
# base -> (hf_dir, tenants, longest datum)
BASES = {"tiny": (None, 8, 2047), "smollm2": (SMOLLM2, 4, 511)}
SAMPLE_EVERY_S = 5.0


def tree_rss_mib(root: int) -> float:
    """Resident memory of ``root`` and every process below it (the launcher, torchrun and
    its workers), MiB."""
    parent, rss = {}, {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            parent[int(pid)] = int(fields[1])
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss[int(pid)] = int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue

    def below(pid: int) -> bool:
        while pid > 1:
            if pid == root:
                return True
            pid = parent.get(pid, 0)
        return False

    return sum(kib for pid, kib in rss.items() if below(pid)) / 1024


class Gate:
    """Holds the tenants between calls, so that the service can be read at rest."""

    def __init__(self, tenants: int) -> None:
        self.tenants, self.idle, self.held = tenants, 0, False
        self.cond = threading.Condition()

    def between_calls(self) -> None:
        with self.cond:
            if not self.held:
                return
            self.idle += 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: not self.held)
            self.idle -= 1

    def hold(self, timeout_s: float) -> bool:
        with self.cond:
            self.held = True
            return self.cond.wait_for(lambda: self.idle >= self.tenants, timeout_s)

    def release(self) -> None:
        with self.cond:
            self.held = False
            self.cond.notify_all()


class Peak:
    """The process tree's highest RSS since the last ``take``, sampled every few seconds."""

    def __init__(self, root: int, stop: threading.Event) -> None:
        self.root, self.stop, self.peak = root, stop, 0.0
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self.stop.wait(SAMPLE_EVERY_S):
            self.peak = max(self.peak, tree_rss_mib(self.root))

    def take(self) -> float:
        peak, self.peak = self.peak, 0.0
        return round(peak, 1)


def _tenant(
    url: str,
    key: str,
    base: str,
    vocab: int,
    longest: int,
    gate: Gate,
    stop: threading.Event,
    errors: list,
) -> None:
    import httpx
    import tinker
    from tinker import types

    rng = random.Random(key)
    service = tinker.ServiceClient(base_url=url, api_key=key)
    client = service.create_lora_training_client(base_model=base, rank=32).result()

    def datum() -> types.Datum:
        n = rng.randint(8, longest)
        tokens = [rng.randrange(3, vocab) for _ in range(n + 1)]
        return types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n},
        )

    i = 0
    while not stop.is_set():
        gate.between_calls()
        try:
            data = [datum() for _ in range(rng.randint(2, 4))]
            client.forward_backward(data, "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=1e-5)).result()
            record = i % 2 == 0
            sampler = client.save_weights_and_get_sampling_client(
                record_stability_info=record
            ).result()
            prompt = types.ModelInput.from_ints([rng.randrange(3, vocab) for _ in range(32)])
            sampler.sample(prompt, 2, types.SamplingParams(max_tokens=16)).result()
            if i % 3 == 0:
                client.save_state(f"soak-{i}", ttl_seconds=600).result()
            if i % 5 == 0:
                _hostile(url, key, client.model_id, errors, httpx)
        except Exception as err:
            errors.append(f"{key}: {type(err).__name__}: {err}"[:300])
        i += 1
    service.close("success").result()


def _hostile(url: str, key: str, model_id: str, errors: list, httpx) -> None:
    """Bodies the front must refuse with a 4xx (never a 5xx or a server path)."""
    headers = {"X-API-Key": key}
    for body in (
        {"model_id": model_id, "path": "a\x00b", "type": "save_weights"},
        {"model_id": model_id, "path": "x" * 5000, "type": "save_weights"},
    ):
        answer = httpx.post(f"{url}/api/v1/save_weights", headers=headers, json=body)
        if not 400 <= answer.status_code < 500 or "/tmp" in answer.text:
            errors.append(f"hostile {body['path'][:8]!r}: {answer.status_code} {answer.text[:200]}")
    answer = httpx.post(
        f"{url}/api/v1/forward", headers={**headers, "Content-Type": "application/json"},
        content=b"{not json",
    )  # fmt: skip
    if not 400 <= answer.status_code < 500:
        errors.append(f"hostile non-JSON: {answer.status_code}")


def _flood(url: str, key: str) -> int:
    """Polls for results that do not exist, from many threads: 404s, quickly."""
    import httpx

    codes: list[int] = []

    def poll() -> None:
        with httpx.Client() as http:
            for n in range(50):
                body = {"request_id": f"req-{10**9 + n}", "type": "future_retrieve"}
                codes.append(
                    http.post(
                        f"{url}/api/v1/retrieve_future", headers={"X-API-Key": key}, json=body
                    ).status_code
                )

    threads = [threading.Thread(target=poll) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(1 for c in codes if c >= 500)


def _at_rest(run_dir: Path, proc, gate: Gate, peak: Peak, loaded_s: float, errors: list) -> dict:
    """Hold the tenants, wait past a heap trim with nothing queued, read the memory."""
    held = gate.hold(timeout_s=1800)
    idle_since = time.monotonic()
    while time.monotonic() - idle_since < TRIM_EVERY_S + 5:
        status = read_status(run_dir) or {}
        if status.get("memory", {}).get("in_all", {}).get("queue", {}).get("count"):
            idle_since = time.monotonic()
        time.sleep(1.0)
    status = read_status(run_dir) or {}
    memory = status.get("memory", {})
    point = {
        "minute": round(loaded_s / 60, 1),
        "rss_mib": round(tree_rss_mib(proc.pid), 1),
        "peak_loaded_mib": peak.take(),
        "worker_rss_mib": memory.get("rss_mib"),
        "kept": {k: [v["count"], v.get("bytes")] for k, v in memory.get("in_all", {}).items()},
        "calls": status.get("step"),
        "errors": len(errors),
        "all_tenants_held": held,
    }
    gate.release()
    return point


def soak(minutes: float, base: str, clock: Clock) -> dict:
    """One base under its tenants for ``minutes`` of load: its memory at rest over time."""
    hf_dir, tenants, longest = BASES[base]
    keys = [f"tml-soak{i}" for i in range(tenants)]
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-soak-{base}-"))
    port, run_dir = free_port(), tmp / "run"
    proc = start_service([f"hf_dir={hf_dir or 'null'}"], run_dir, port, tmp / "service.log", keys)
    url = f"http://127.0.0.1:{port}"
    vocab = 264 if hf_dir is None else 49152
    name = "tiny" if hf_dir is None else hf_dir.name
    stop, errors, gate = threading.Event(), [], Gate(tenants)
    threads = [
        threading.Thread(target=_tenant, args=(url, k, name, vocab, longest, gate, stop, errors))
        for k in keys
    ]
    timeline, peak = [], Peak(proc.pid, stop)
    started_rss = round(tree_rss_mib(proc.pid), 1)  # serving, no tenant yet
    try:
        for t in threads:
            t.start()
        for tick in range(1, 13):
            time.sleep(minutes * 60 / 12)
            point = _at_rest(run_dir, proc, gate, peak, tick * minutes * 60 / 12, errors)
            timeline.append(point)
            clock.say(f"soak {base}: {json.dumps(point)}")
        stop.set()
        for t in threads:
            t.join(600)
        flood_5xx = _flood(url, keys[0])
        end_rss = tree_rss_mib(proc.pid)
    finally:
        stop.set()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)
    return {
        "rss_started_mib": started_rss,
        "timeline": timeline,
        "errors": errors[:20],
        "error_count": len(errors),
        "flood_5xx": flood_5xx,
        "rss_after_flood_mib": end_rss,
    }


def section_soak(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    chosen = os.environ.get("SOAK_BASES", ",".join(BASES)).split(",")
    out.soak, runs = {}, []
    for base in chosen:
        hf_dir, tenants, longest = BASES[base]
        title = f"training service RSS at rest, {tenants} tenants ({base})"
        if hf_dir is not None and not hf_dir.is_dir():
            out.rows.append(Row("17", title, "", "", "", "MiB", skipped=f"no {hf_dir}"))
            continue

        def run(base: str = base) -> None:
            try:
                out.soak[base] = soak(s.minutes, base, clock)
            except Exception as err:  # raised again below, from this thread
                out.soak[base] = err

        runs.append((base, title, tenants, longest, threading.Thread(target=run)))
    for *_, thread in runs:
        thread.start()
    for base, title, tenants, longest, thread in runs:
        thread.join()
        result = out.soak[base]
        if isinstance(result, Exception):
            raise result
        timeline = result["timeline"]
        early = timeline[1]  # a sixth of the run: 10 minutes of an hour
        row = Row(
            "17a" if base == "tiny" else "17b",
            title,
            f"{tenants} tinker SDK tenants for {s.minutes} min of load (forward_backward of "
            f"2-4 datums up to {longest} tokens, optim_step, sample from new sampler weights, "
            f"save_state, hostile bodies); {result['error_count']} unexpected answers, "
            f"{result['flood_5xx']} 5xx in the final flood",
            f"at {timeline[-1]['minute']} min",
            f"at {early['minute']} min",
            "MiB",
            note=f"goal: within 5%; {result['rss_started_mib']} MiB at start, no tenant yet; "
            f"peak while loaded {max(p['peak_loaded_mib'] for p in timeline)} MiB",
        )
        out.rows.append(row.fill(timeline[-1]["rss_mib"], early["rss_mib"]))

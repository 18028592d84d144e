"""Row 16a: RL for 4 tenants through the training service (``mmlora api``): each tenant's step
is a Tinker RL step (new sampler weights, a group of samples per prompt, their advantages,
forward_backward with importance sampling, optim_step), all 4 tenants at once (their calls
share the service's steps and generation passes) vs the same tenants one after another (a
service answering one client at a time, as one that swaps adapters in and out does, minus
the swapping)."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from pathlib import Path

import torch

from benchmarks.api_service import CLIENTS, KEYS, free_port, launch
from benchmarks.report import Results, Row
from benchmarks.settings import Settings
from benchmarks.timing import Clock, medians, time_side_by_side

PROMPTS, GROUP, NEW_TOKENS, STEPS = 4, 4, 16, 3


def _rl_step(client, prompts: list[list[int]]) -> None:
    """One RL step of a tenant: sample, score, train."""
    from tinker import types

    sampler = client.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0)
    futures = [sampler.sample(types.ModelInput.from_ints(p), GROUP, params) for p in prompts]
    data = []
    for prompt, future in zip(prompts, futures):
        sequences = future.result().sequences
        rewards = [sum(s.tokens) % 7 / 6 for s in sequences]  # a reward that varies
        mean = sum(rewards) / len(rewards)
        for seq, reward in zip(sequences, rewards):
            n, advantage = len(seq.tokens), reward - mean
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": prompt[1:] + seq.tokens,
                        "logprobs": [0.0] * (len(prompt) - 1) + list(seq.logprobs),
                        "advantages": [0.0] * (len(prompt) - 1) + [advantage] * n,
                    },
                )
            )
    client.forward_backward(data, "importance_sampling").result()
    client.optim_step(types.AdamParams(learning_rate=1e-4)).result()


def section_rl(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    import tinker

    if device.type != "cpu":
        out.rows.append(Row("16a", "RL tenants", "", "", "", "s", skipped="runs on CPU"))
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-rl-"))
    port = free_port()
    clock.say(f"rl: starting the service ({CLIENTS} slots)")
    proc = launch(s, tmp / "run", port, tmp / "service.log")
    try:
        services = [
            tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=k) for k in KEYS
        ]
        clients = [
            sc.create_lora_training_client(base_model="tiny", rank=s.rank, seed=i).result()
            for i, sc in enumerate(services)
        ]
        prompts = [[(7 * t + 3 * k) % 200 + 5 for k in range(24)] for t in range(PROMPTS)]

        def tenant(i: int) -> None:
            for _ in range(STEPS):
                _rl_step(clients[i], prompts)

        def at_once() -> None:
            threads = [threading.Thread(target=tenant, args=(i,)) for i in range(CLIENTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        def one_after_another() -> None:
            for i in range(CLIENTS):
                tenant(i)

        samples = time_side_by_side(
            clock,
            "16a",
            {"at once": at_once, "one after another": one_after_another},
            rounds=5,
            warmup=1,
        )
        out.samples["rl"] = samples
        for sc in services:
            sc.close("success").result()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    med = medians(samples)
    row = Row(
        "16a",
        f"{CLIENTS} RL tenants x {STEPS} steps: one batched service vs one tenant at a time",
        (
            f"{CLIENTS} tinker SDK tenants (one thread each), each {STEPS} RL steps: sampler "
            f"weights saved, {PROMPTS} prompts x {GROUP} samples of {NEW_TOKENS} tokens, "
            "importance_sampling forward_backward on them, optim_step; rank "
            f"{s.rank}, mmlora api on the dense GPT of rows 1c/2c: all tenants at once vs the "
            "same tenants one after another"
        ),
        "at once",
        "one after another",
        "s",
    ).fill(med["at once"], med["one after another"])
    row.note = f"At once is {med['one after another'] / med['at once']:.2f}x the throughput."
    out.rows.append(row)

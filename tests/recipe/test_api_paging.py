"""More training clients than device slots: the service pages their adapters (weights,
optimizer state, gradients accumulated between forward_backward and optim_step) through its
slots, invisibly to the tinker SDK: five clients taking turns in two slots get the same bits
as in a service that holds each in a slot of its own; a creation beyond
api.max_training_clients is answered 429."""

from __future__ import annotations

import json
import time

import pytest
import tinker
from tinker import types

from tests.recipe.test_api_service import ADAM, KEYS, Service, datums_of, free_port

CLIENTS = 5


def _rounds(service: Service) -> tuple[list, list]:
    """Each of five clients, one call at a time (each batch holds one client): two
    forward_backwards (accumulating) then an optim_step, twice round; then a sample from
    the first client's saved weights."""
    sc = service.client()
    clients = [
        sc.create_lora_training_client(base_model="tiny", rank=8, seed=20 + i).result()
        for i in range(CLIENTS)
    ]
    losses, norms = [], []
    for r in range(2):
        for i, client in enumerate(clients):
            for k in range(2):
                tokens = [(7 * i + 3 * k + r + t) % 60 + 2 for t in range(24)]
                out = client.forward_backward(datums_of(tokens), "cross_entropy").result(120)
                losses.append(out.metrics["loss:sum"])
            step = client.optim_step(types.AdamParams(learning_rate=1e-2, **ADAM)).result(120)
            norms.append(step.metrics["grad_norm:mean"])
    sampler = clients[0].save_weights_and_get_sampling_client("first")
    sample = sampler.sample(
        types.ModelInput.from_ints([5, 6, 7]),
        1,
        types.SamplingParams(max_tokens=6, temperature=0.0),
    ).result(120)
    return losses + norms, list(sample.sequences[0].tokens)


@pytest.mark.timeout(900)
def test_clients_beyond_the_device_slots_are_paged_invisibly(tmp_path):
    paged = Service(
        tmp_path / "paged",
        free_port(),
        tmp_path / "paged.log",
        overrides=("hf_dir=null", f"api.max_training_clients={CLIENTS}"),
        slots=2,
    )
    try:
        got = _rounds(paged)
        time.sleep(1.5)  # the status is written at most once a second
        paging = json.loads((tmp_path / "paged" / "serve" / "status.json").read_text())["paging"]
        # the scenario happened: each client's turn of a round (its three calls) paged it in
        assert paging["pages_out"] >= 10 and paging["pages_in"] >= 10, paging
        # a sixth client is over the bound: 429, with what to do
        with pytest.raises(tinker.RateLimitError, match=r"api\.max_training_clients"):
            paged.client(KEYS[1]).create_lora_training_client(base_model="tiny", rank=8).result(120)
    finally:
        paged.stop()
    resident = Service(tmp_path / "resident", free_port(), tmp_path / "resident.log", slots=8)
    try:
        want = _rounds(resident)
    finally:
        resident.stop()
    assert got == want  # the same bits: paging is invisible
    log = (tmp_path / "paged.log").read_text()
    assert "2 adapter slots, up to 5 training clients (those beyond the slots paged" in log


@pytest.mark.timeout(300)
def test_paged_clients_are_bounded_by_host_memory_as_well_as_by_their_count(tmp_path):
    """api.paged_adapters_mb too small for one page: the service holds only its two slots'
    clients, says so at start, and answers a third creation 429 naming that setting."""
    service = Service(
        tmp_path / "run",
        free_port(),
        tmp_path / "run.log",
        overrides=("hf_dir=null", "api.paged_adapters_mb=0.01"),
        slots=2,
    )
    try:
        sc = service.client()
        for seed in (1, 2):
            sc.create_lora_training_client(base_model="tiny", rank=8, seed=seed).result(120)
        with pytest.raises(tinker.RateLimitError, match=r"api\.paged_adapters_mb"):
            sc.create_lora_training_client(base_model="tiny", rank=8).result(120)
    finally:
        service.stop()
    log = (tmp_path / "run.log").read_text()
    assert "api.max_training_clients=256 would page 254 clients to host memory at" in log
    assert "api.paged_adapters_mb=0.01 fits 0 pages beside those, so the service holds 2" in log
    assert "2 adapter slots, up to 2 training clients" in log

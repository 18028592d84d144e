"""Gemma 3 text (4 layers: sliding, full, sliding, full) under TP=2, TP=2 with sequence
parallelism and PP=2: Megatron logits equal transformers' within 1e-4 (fp32).

Under PP=2 each stage holds one sliding and one full layer; only the first stage has the
(scaled) embedding, the last one the output layer tied to the unscaled embedding weights.
"""

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_multilora.models.hf_import import load_hf_model
from tests.distributed.conftest import assert_all_ranks
from tests.distributed.test_hf_import_parallel import saved_checkpoint
from tests.hf_models import hf_logits, make_hf_model, megatron_logits, token_batch

pytest.importorskip("transformers")

TOL = 1e-4  # max |logit difference|, logits of size ~10; observed ~5e-6


def gemma3(seed: int = 11):
    return make_hf_model("gemma3_text", seed=seed, num_hidden_layers=4)


def check(
    failures: list[str], got: torch.Tensor, want: torch.Tensor, what: str, tol: float = TOL
) -> None:
    err = (got - want).abs().max().item()
    print(f"{what}: max |logit diff| = {err:.2e}")
    if err > tol:
        failures.append(f"{what}: max |logit diff| {err:.3e} > {tol}")


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_logits_match_transformers(layout, sp):
    layout(tp=2, sp=sp)
    hf_model = gemma3()
    with saved_checkpoint(hf_model) as folder:
        model, _ = load_hf_model(folder, sequence_parallel=sp)
    failures: list[str] = []
    for seed in range(3):
        ids = token_batch(seed)
        check(failures, megatron_logits(model, ids), hf_logits(hf_model, ids), f"sp={sp} {seed}")
    assert_all_ranks(failures)


def pipelined_logits(model: torch.nn.Module, ids: torch.Tensor, hidden: int):
    """Forward through two pipeline stages: the first sends its hidden states ``[s, b, h]``
    to the last, which returns the logits (None on the first stage)."""
    positions = torch.arange(ids.size(1))[None].expand_as(ids)
    if parallel_state.is_pipeline_first_stage():
        out = model(ids, positions, None)
        dist.send(out.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
        return None
    received = torch.empty(ids.size(1), ids.size(0), hidden)
    dist.recv(received, parallel_state.get_pipeline_model_parallel_prev_rank())
    model.set_input_tensor(received)
    return model(ids, positions, None, runtime_gather_output=True)


def test_pp2_logits_match_transformers(layout):
    layout(pp=2)
    hf_model = gemma3(seed=5)
    with saved_checkpoint(hf_model) as folder:
        model, cfg = load_hf_model(folder)
    failures: list[str] = []
    types = [cfg.layer_types[layer.layer_number - 1] for layer in model.decoder.layers]
    if sorted(types) != ["full_attention", "sliding_attention"]:
        failures.append(f"stage holds layer types {types}, want one of each")
    with torch.no_grad():
        for seed in range(3):
            ids = token_batch(seed)
            got = pipelined_logits(model, ids, cfg.hidden_size)
            if got is not None:
                check(failures, got, hf_logits(hf_model, ids), f"pp2 {seed}")
    assert_all_ranks(failures)

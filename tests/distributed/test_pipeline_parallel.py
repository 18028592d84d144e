"""Pipeline stages against the unpipelined model: a GPT built from a config at PP=2 (1F1B)
and at PP=2 with two virtual stages (interleaved, 4 layers) holds the same base weights per
global layer as at PP=1, and megatron's ``get_forward_backward_func`` over its stages gives
PP=1's losses (last stage) and gradients (every stage, keyed by global layer).

The PP=1 reference runs first in each process (data parallel over both, no gradient sync),
then the same processes re-initialise as pipeline stages.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

import megatron_multilora as mm
from megatron_multilora.models.gpt import build_model_chunks
from megatron_multilora.training.step.micro_batches import MicroBatch
from tests.distributed.conftest import assert_all_ranks, compare

SEQ, N_MICRO = 16, 4
LENGTHS = [[5, 7, 4], [16], [3, 3, 10], [9, 7]]  # examples per packed micro-batch
REL = 1e-5  # observed ~1e-7: the same fp32 ops in the same order, only split over stages
DENSE = dict(
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    vocab_size=64,
    max_sequence_length=SEQ,
)
MOE = dict(DENSE, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)


def micro_batches(vocab: int) -> list[MicroBatch]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for lengths in LENGTHS:
        tokens = torch.randint(0, vocab, (1, SEQ), generator=gen)
        labels = torch.randint(0, vocab, (1, SEQ), generator=gen)
        loss_mask = (torch.rand(1, SEQ, generator=gen) > 0.2).float()
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        out.append(
            MicroBatch(
                tokens,
                labels,
                loss_mask,
                positions,
                counts=[SEQ],
                examples_per_slot=[len(lengths)],
                seq_lengths=lengths,
            )
        )
    return out


def forward_step(data_iterator, model):
    mb = next(data_iterator)
    token_loss = model(
        mb.tokens, mb.position_ids, None, labels=mb.labels, packed_seq_params=mb.packed_seq_params()
    )

    def loss_func(output: torch.Tensor):
        loss = (output.float() * mb.loss_mask).sum() / mb.loss_mask.sum()
        return loss, {"loss": loss.detach()}

    return token_loss, loss_func


def run(chunks: list[torch.nn.Module], batches: list[MicroBatch]) -> list[torch.Tensor]:
    """Forward and backward of ``batches`` through megatron's schedule for this layout; the
    per-micro-batch losses on the last stage, [] elsewhere."""
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=1,
        forward_only=False,
    )
    return [o["loss"] for o in out]


def by_global_key(chunks: list[torch.nn.Module], what: str) -> dict[str, torch.Tensor]:
    """Each parameter (``what="data"``) or its gradient (``"grad"``) under its PP=1 key."""
    out = {}
    for chunk in chunks:
        numbers = [layer.layer_number - 1 for layer in chunk.decoder.layers]
        for key, param in chunk.named_parameters():
            key = re.sub(
                r"^decoder\.layers\.(\d+)\.",
                lambda m, numbers=numbers: f"decoder.layers.{numbers[int(m[1])]}.",
                key,
            )
            value = getattr(param, what)
            out[key] = None if value is None else value.detach().clone()
    return out


@pytest.mark.parametrize(
    "pp,vpp,num_layers", [(2, None, 2), (2, 2, 4)], ids=["1f1b", "interleaved"]
)
@pytest.mark.parametrize("model", ["dense", "dense_tied", "moe", "moe_tied"])
def test_pipeline_stages_match_pp1(layout, pp, vpp, num_layers, model):
    cfg = mm.GPTModelConfig(
        num_layers=num_layers,
        tie_word_embeddings=model.endswith("tied"),
        **(MOE if model.startswith("moe") else DENSE),
    )
    batches = micro_batches(cfg.vocab_size)

    layout()
    reference = build_model_chunks(cfg)
    want_losses = run(reference, batches)
    want_weights, want_grads = by_global_key(reference, "data"), by_global_key(reference, "grad")
    del reference

    layout(pp=pp, vpp=vpp)
    chunks = build_model_chunks(cfg)
    failures: list[str] = []
    rank = parallel_state.get_pipeline_model_parallel_rank()
    # Megatron's layer placement: chunk c of rank r holds global layers
    # (c * pp + r) * per_chunk ... + per_chunk - 1.
    per_chunk = num_layers // (pp * (vpp or 1))
    want_layers = [
        [(c * pp + rank) * per_chunk + i for i in range(per_chunk)] for c in range(vpp or 1)
    ]
    got_layers = [[layer.layer_number - 1 for layer in c.decoder.layers] for c in chunks]
    if got_layers != want_layers:
        failures.append(f"holds layers {got_layers}, want {want_layers}")
    weights = by_global_key(chunks, "data")
    if cfg.tie_word_embeddings and "output_layer.weight" in weights:  # last stage's copy
        compare(
            failures,
            weights.pop("output_layer.weight"),
            want_weights["embedding.word_embeddings.weight"],
            0.0,
            "tied output copy",
        )
    for key, value in weights.items():
        compare(failures, value, want_weights[key], 0.0, f"initial {key}")

    losses = run(chunks, batches)
    last = parallel_state.is_pipeline_last_stage()
    if len(losses) != (N_MICRO if last else 0):
        failures.append(f"{len(losses)} losses on {'the last' if last else 'a first'} stage")
    for i, (got, want) in enumerate(zip(losses, want_losses)):
        compare(failures, got, want, REL, f"loss of micro-batch {i}")
    grads = by_global_key(chunks, "grad")
    if cfg.tie_word_embeddings:
        # The tied weight's gradient is split: its input part on the first stage, its output
        # part on the last; their sum (megatron's embedding-group all-reduce) is PP=1's.
        part = grads.pop("embedding.word_embeddings.weight", None)
        part = grads.pop("output_layer.weight") if part is None else part
        dist.all_reduce(part, group=parallel_state.get_embedding_group())
        compare(
            failures,
            part,
            want_grads["embedding.word_embeddings.weight"],
            REL,
            "tied embedding grad (stages summed)",
        )
    if not any(key.startswith("decoder.layers.") for key in grads):
        failures.append("no layer gradients compared")
    for key, grad in grads.items():
        if grad is None:
            failures.append(f"{key}: no gradient")
            continue
        compare(failures, grad, want_grads[key], REL, f"grad {key}")
    assert_all_ranks(failures)


def test_build_refuses_layers_that_do_not_split_into_chunks(layout):
    layout(pp=2, vpp=2)
    with pytest.raises(
        ValueError,
        match="num_layers=2 does not split into pipeline 2 x "
        "virtual stages 2 = 4 equal model chunks",
    ):
        build_model_chunks(mm.GPTModelConfig(num_layers=2, **DENSE))
    with pytest.raises(ValueError, match="use build_model_chunks"):
        mm.build_gpt_model(mm.GPTModelConfig(num_layers=4, **DENSE))

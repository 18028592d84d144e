"""The log-prob of every target token of many slots' examples in one forward-only pass,
with the adapters on (the policy) or off (the frozen base: the reference of DPO and of
GRPO's KL, which costs no second model)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from megatron_multilora.data.datasets import Packable
from megatron_multilora.layers.lifecycle import ModelOrChunks, adapters_off, model_chunks
from megatron_multilora.training.step.micro_batches import MicroBatch, MicroBatcher
from megatron_multilora.training.step.schedule import eval_mode, per_example, run_schedule


def _target_logprobs(
    mb: MicroBatch, token_loss: torch.Tensor, non_loss_data: bool = True
) -> torch.Tensor:
    return -token_loss[0].float()


@torch.no_grad()
def target_logprobs(
    model: ModelOrChunks,
    slot_examples: Sequence[Sequence[Packable]],
    batcher: MicroBatcher,
    adapters: bool = False,
) -> list[list[list[float]]]:
    """Per slot, per example (groups flattened, in order), the log-prob of each of its
    targets (``len(tokens) - 1`` floats; 0 where its loss mask is not set), on every rank
    and stage. Every rank of the world
    takes part with the same examples."""
    chunks = model_chunks(model)
    micro_batches = batcher.ready(slot_examples)
    device = next(chunks[0].parameters()).device
    with eval_mode(chunks), contextlib.nullcontext() if adapters else adapters_off(chunks):
        store = run_schedule(
            chunks, micro_batches, _target_logprobs, forward_only=True, collect_non_loss_data=True
        )
    return per_example(micro_batches, store, len(slot_examples), device)

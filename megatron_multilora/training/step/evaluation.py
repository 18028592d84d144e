"""Held-out loss of many adapters at once.

Evaluation runs the same packed, adapter-major micro-batches as training, forward-only
through megatron's pipeline schedule, so one forward serves every adapter; every rank
evaluates the same samples (no data-parallel split), which keeps expert-parallel collectives
in step and needs no reduction of the results. Results come from the last pipeline stage,
broadcast to every stage.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from megatron_multilora.data.datasets import Example
from megatron_multilora.layers.lifecycle import ModelOrChunks, model_chunks
from megatron_multilora.training.step.micro_batches import MicroBatcher
from megatron_multilora.training.step.schedule import per_slot_losses


@contextlib.contextmanager
def eval_mode(chunks: list[torch.nn.Module]) -> Iterator[None]:
    modes = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    try:
        yield
    finally:
        for chunk, mode in zip(chunks, modes):
            chunk.train(mode)


def eval_losses(model: ModelOrChunks, slot_examples: Sequence[Sequence[Example]],
                token_budget: int, pad_multiple: int, pad_id: int) -> torch.Tensor:
    """``[n_slots]`` mean loss over each slot's examples' loss tokens (nan: no examples)."""
    chunks = model_chunks(model)
    micro_batches = MicroBatcher(chunks, len(slot_examples), token_budget, pad_multiple,
                                 pad_id).ready(slot_examples)
    denominators = torch.zeros(len(slot_examples), dtype=torch.int64)
    for mb in micro_batches:
        denominators += mb.loss_tokens_per_slot()
    with eval_mode(chunks):
        per_slot = per_slot_losses(chunks, micro_batches, denominators, forward_only=True)
    return torch.where(denominators > 0, per_slot, torch.full_like(per_slot, float("nan"))).float()



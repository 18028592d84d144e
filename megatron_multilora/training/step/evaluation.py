"""Held-out loss of many adapters at once.

Evaluation runs the same packed, adapter-major micro-batches as training, forward-only
through megatron's pipeline schedule, so one forward serves every adapter. Every rank is
given the same samples; each data-parallel rank evaluates every ``world``-th one, and the
per-slot sums (weighted by the global loss-unit counts, as in training) are summed over the
data-parallel group. The micro-batch count is agreed as in training, so expert-parallel
peers stay in step. Results come from the last pipeline stage, broadcast to every stage.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
from megatron.core import parallel_state

from megatron_multilora.data.datasets import Packable
from megatron_multilora.layers.lifecycle import ModelOrChunks, model_chunks
from megatron_multilora.parallel import data_parallel_sum
from megatron_multilora.training.step.micro_batches import MicroBatcher
from megatron_multilora.training.objectives.objective import Objective
from megatron_multilora.training.step.schedule import per_slot_results


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


def eval_results(model: ModelOrChunks, slot_examples: Sequence[Sequence[Packable]],
                 token_budget: int, pad_multiple: int, pad_id: int,
                 objectives: Optional[Sequence[Optional[Objective]]] = None) -> torch.Tensor:
    """``[n_slots, 1 + MAX_METRICS]``: each slot's mean loss over its examples' loss units by
    its objective (``objectives[s]``, default SFT), then the objective's metrics (nan: no
    examples). Every rank passes the same ``slot_examples``."""
    chunks = model_chunks(model)
    world = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    shares = [list(examples)[rank::world] for examples in slot_examples]
    micro_batches = MicroBatcher(chunks, len(slot_examples), token_budget, pad_multiple,
                                 pad_id).ready(shares)
    denominators = torch.zeros(len(slot_examples), dtype=torch.int64)
    for mb in micro_batches:
        denominators += mb.loss_units_per_slot()
    denominators = data_parallel_sum(denominators)
    with eval_mode(chunks):
        table = data_parallel_sum(per_slot_results(chunks, micro_batches, denominators, True,
                                                    objectives))
    return torch.where((denominators > 0)[:, None], table,
                       torch.full_like(table, float("nan"))).float()


def eval_losses(model: ModelOrChunks, slot_examples: Sequence[Sequence[Packable]],
                token_budget: int, pad_multiple: int, pad_id: int) -> torch.Tensor:
    """``[n_slots]`` mean loss over each slot's examples' loss tokens (nan: no examples)."""
    return eval_results(model, slot_examples, token_budget, pad_multiple, pad_id)[:, 0]

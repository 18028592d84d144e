"""Held-out loss of many adapters at once.

Evaluation runs the same packed, adapter-major micro-batches as training, forward-only
through megatron's pipeline schedule, so one forward serves every adapter. Every rank is
given the same samples; each data-parallel rank evaluates every ``world``-th one, and the
per-slot sums (weighted by the global loss-unit counts, as in training) are summed over the
data-parallel group. The micro-batch count is agreed as in training, so expert-parallel
peers stay in step. Results come from the last pipeline stage, broadcast to every stage.
The same pass can also give each held-out position's clear greedy choice
(:func:`eval_results_and_choices`), from which most greedy generations are known.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_multilora.data.datasets import Packable, examples_of
from megatron_multilora.layers.lifecycle import ModelOrChunks, model_chunks
from megatron_multilora.parallel import data_parallel_sum
from megatron_multilora.training.objectives.objective import Objective
from megatron_multilora.training.step.micro_batches import MicroBatcher
from megatron_multilora.training.step.schedule import per_slot_results_and_data


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


def eval_results(
    model: ModelOrChunks,
    slot_examples: Sequence[Sequence[Packable]],
    token_budget: int,
    pad_multiple: int,
    pad_id: int,
    objectives: Sequence[Objective | None] | None = None,
) -> torch.Tensor:
    """``[n_slots, 1 + MAX_METRICS]``: each slot's mean loss over its examples' loss units by
    its objective (``objectives[s]``, default the registry's DEFAULT), then the objective's
    metrics (nan: no examples). Every rank passes the same ``slot_examples``."""
    return _evaluate(model, slot_examples, token_budget, pad_multiple, pad_id, objectives, keep=())[
        0
    ]


def eval_results_and_choices(
    model: ModelOrChunks,
    slot_examples: Sequence[Sequence[Packable]],
    token_budget: int,
    pad_multiple: int,
    pad_id: int,
    objectives: Sequence[Objective | None] | None = None,
) -> tuple[torch.Tensor, list[list[list[list[int]]]]]:
    """:func:`eval_results`, and per slot, per item of ``slot_examples[s]`` (in order), per
    example of the item, at each position the clear greedy choice after the tokens up to it
    where its loss mask is set (-1 elsewhere; -1 everywhere where the output layer runs
    whole), on every rank: ``schedule.per_slot_results_and_data``'s ``"choices"``."""
    table, kept = _evaluate(
        model, slot_examples, token_budget, pad_multiple, pad_id, objectives, keep=("choices",)
    )
    world = parallel_state.get_data_parallel_world_size()
    everyone = [None] * world
    if world > 1:
        dist.all_gather_object(
            everyone, kept["choices"], group=parallel_state.get_data_parallel_group()
        )
    else:
        everyone = [kept["choices"]]
    choices: list[list[list[list[int]]]] = []
    for slot, examples in enumerate(slot_examples):
        per_rank = [iter(share[slot]) for share in everyone]  # each rank's in packing order
        choices.append(
            [
                [next(per_rank[i % world]) for _ in examples_of(item)]
                for i, item in enumerate(examples)
            ]
        )
    return table, choices


def _evaluate(
    model: ModelOrChunks,
    slot_examples: Sequence[Sequence[Packable]],
    token_budget: int,
    pad_multiple: int,
    pad_id: int,
    objectives: Sequence[Objective | None] | None,
    keep: Sequence[str],
) -> tuple[torch.Tensor, dict]:
    chunks = model_chunks(model)
    world = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    shares = [list(examples)[rank::world] for examples in slot_examples]
    micro_batches = MicroBatcher(
        chunks, len(slot_examples), token_budget, pad_multiple, pad_id
    ).ready(shares)
    denominators = torch.zeros(len(slot_examples), dtype=torch.int64)
    for mb in micro_batches:
        denominators += mb.loss_units_per_slot()
    denominators = data_parallel_sum(denominators)
    with eval_mode(chunks):
        table, kept = per_slot_results_and_data(
            chunks, micro_batches, denominators, True, objectives, keep
        )
    table = data_parallel_sum(table)
    return torch.where(
        (denominators > 0)[:, None], table, torch.full_like(table, float("nan"))
    ).float(), kept


def eval_losses(
    model: ModelOrChunks,
    slot_examples: Sequence[Sequence[Packable]],
    token_budget: int,
    pad_multiple: int,
    pad_id: int,
) -> torch.Tensor:
    """``[n_slots]`` mean loss over each slot's examples' loss tokens (nan: no examples)."""
    return eval_results(model, slot_examples, token_budget, pad_multiple, pad_id)[:, 0]

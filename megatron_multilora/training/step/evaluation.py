"""Held-out loss of many adapters at once: the step's forward pass
(:meth:`.slot_step.SlotStep.forward`) over every slot's held-out examples, so one forward
serves every adapter. Every rank is given the same examples; each data-parallel rank
evaluates every ``world``-th one, and each slot's mean over its loss units comes from the
last pipeline stage, the same on every rank. The same pass can also give each held-out
position's clear greedy choice (:func:`eval_results_and_choices`), from which most greedy
generations are known.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_multilora.data.datasets import Packable, examples_of
from megatron_multilora.training.objectives.objective import Objective
from megatron_multilora.training.objectives.registry import DEFAULT
from megatron_multilora.training.step.slot_step import SlotStep, SlotWork, StepResult


def eval_results(
    step: SlotStep,
    slot_examples: Sequence[Sequence[Packable]],
    objectives: Sequence[Objective | None] | None = None,
) -> torch.Tensor:
    """``[n_slots, 1 + MAX_METRICS]``: each slot's mean loss over its examples' loss units by
    its objective (``objectives[s]``, default the registry's DEFAULT), then the objective's
    metrics (nan: no examples)."""
    return _table(_evaluate(step, slot_examples, objectives, ()))


def eval_results_and_choices(
    step: SlotStep,
    slot_examples: Sequence[Sequence[Packable]],
    objectives: Sequence[Objective | None] | None = None,
) -> tuple[torch.Tensor, list[list[list[list[int]]]]]:
    """:func:`eval_results`, and per slot, per item of ``slot_examples[s]`` (in order), per
    example of the item, at each position the clear greedy choice after the tokens up to it
    where its loss mask is set (-1 elsewhere; -1 everywhere where the output layer runs
    whole), on every rank: ``schedule.per_slot_results_and_data``'s ``"choices"``."""
    result = _evaluate(step, slot_examples, objectives, ("choices",))
    choices = []
    for slot, items in enumerate(slot_examples):
        flat = iter(result.kept["choices"].get(slot, []))
        choices.append([[next(flat) for _ in examples_of(item)] for item in items])
    return _table(result), choices


def eval_losses(step: SlotStep, slot_examples: Sequence[Sequence[Packable]]) -> torch.Tensor:
    """``[n_slots]`` mean loss over each slot's examples' loss tokens (nan: no examples)."""
    return eval_results(step, slot_examples)[:, 0]


def _evaluate(
    step: SlotStep,
    slot_examples: Sequence[Sequence[Packable]],
    objectives: Sequence[Objective | None] | None,
    keep: Sequence[str],
) -> StepResult:
    chosen = objectives or [None] * len(slot_examples)
    work = {
        s: SlotWork(items, chosen[s] or DEFAULT()) for s, items in enumerate(slot_examples) if items
    }
    return step.forward(work, keep)


def _table(result: StepResult) -> torch.Tensor:
    return torch.cat([result.losses[:, None], result.metrics], dim=1).float()

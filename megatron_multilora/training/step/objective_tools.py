"""What an objective's preparation gets from the step's side (``objectives.objective.RunTools``):
the base's log-probs of its rows and samples of its adapters, each one pass for all the
objective's jobs; the training service samples for its clients through the same."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from megatron_multilora.data.datasets import Packable
from megatron_multilora.training.objectives.objective import SampleRequest
from megatron_multilora.training.step import generation
from megatron_multilora.training.step.micro_batches import MicroBatcher
from megatron_multilora.training.step.reference import target_logprobs
from megatron_multilora.training.step.sampling import KeyedSampler, RowSampling


@dataclasses.dataclass
class StepTools:
    """The tools of a run's ``model`` (its chunks) and ``batcher`` (packing for all slots)."""

    model: Any
    batcher: MicroBatcher
    tokenizer: Any
    seed: int
    max_seq_len: int
    fail: Callable[[Any, str], None]

    def reference_logprobs(self, by_slot: dict[int, Sequence[Packable]]) -> dict[int, list]:
        slot_examples: list[Sequence[Packable]] = [[] for _ in range(self.batcher.n_slots)]
        for slot, items in by_slot.items():
            slot_examples[slot] = items
        refs = target_logprobs(self.model, slot_examples, self.batcher)
        return {slot: refs[slot] for slot in by_slot}

    def generate(self, requests: Sequence[SampleRequest]) -> list[generation.Generation]:
        return generation.generate(
            self.model,
            [(r.slot, r.prompt) for r in requests],
            self.batcher.n_slots,
            [r.max_new_tokens for r in requests],
            self.tokenizer.eos_id,
            self.batcher.pad_multiple,
            self.tokenizer.pad_id,
            pick=KeyedSampler([RowSampling(r.key, r.temperature, r.top_p) for r in requests]),
            stops=[r.stop_tokens for r in requests],
        )

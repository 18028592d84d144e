"""Supervised fine-tuning: the mean cross-entropy over the adapter's completion tokens."""

from __future__ import annotations

from megatron_multilora.training.objectives.objective import Objective
from megatron_multilora.training.objectives.token_losses import cross_entropy, segment_sums


class SFT(Objective):
    name = "sft"

    def span_loss(self, logprobs, mask, values, sequence):
        return cross_entropy(logprobs, mask).sum(), logprobs.new_zeros(0)

    @classmethod
    def spans_loss(cls, objectives, logprobs, mask, values, sequence, spans):
        # Every span's sum in one op, each summed in order over its own positions (so a
        # span's sum does not depend on its neighbours), in float64.
        return segment_sums(cross_entropy(logprobs, mask), spans), logprobs.new_zeros(len(spans), 0)

"""Supervised fine-tuning: the mean cross-entropy over the adapter's completion tokens."""

from __future__ import annotations

from megatron_multilora.training.objectives.objective import Objective
from megatron_multilora.training.objectives.token_losses import cross_entropy


class SFT(Objective):
    name = "sft"

    def span_loss(self, logprobs, mask, values, sequence):
        return cross_entropy(logprobs, mask).sum(), logprobs.new_zeros(0)

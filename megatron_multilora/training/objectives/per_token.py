"""A loss over per-token inputs a client sends (the training service's objective): one of
:mod:`.token_losses` by Tinker's name, summed over the datum's positions. The sum is not
normalised: as Tinker's, a client's loss and gradient are sums over its datums (it scales
them itself, e.g. with ``weights``).

Inputs per position (``Example.values``): ``cross_entropy``: ``weights``;
``importance_sampling`` and ``ppo``: ``logprobs`` (the sampler's) and ``advantages``.
"""

from __future__ import annotations

from megatron_multilora.training.objectives.loss_inputs import INPUTS
from megatron_multilora.training.objectives.objective import Objective
from megatron_multilora.training.objectives.token_losses import (
    cross_entropy,
    importance_sampling,
    ppo,
)


class PerTokenLoss(Objective):
    name = "per_token"

    def __init__(self, loss: str, clip_low: float = 0.2, clip_high: float = 0.2) -> None:
        """``loss``: a key of INPUTS; ``ppo`` clips the ratio to [1 - clip_low, 1 + clip_high]."""
        if loss not in INPUTS:
            raise ValueError(f"unknown loss {loss!r}: use one of {', '.join(INPUTS)}")
        self.loss = loss
        self._per_token = {
            "cross_entropy": lambda lp, v: cross_entropy(lp, v["weights"]),
            "importance_sampling": lambda lp, v: importance_sampling(
                lp, v["logprobs"], v["advantages"]
            ),
            "ppo": lambda lp, v: ppo(lp, v["logprobs"], v["advantages"], clip_low, clip_high),
        }[loss]

    def span_loss(self, logprobs, mask, values, sequence):
        return (self._per_token(logprobs, values) * mask).sum(), logprobs.new_zeros(0)

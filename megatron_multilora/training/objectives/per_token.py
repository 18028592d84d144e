"""A loss over per-token inputs a client sends (the training service's objective): one of
:mod:`.token_losses` by Tinker's name, summed over the datum's positions. The sum is not
normalised: as Tinker's, a client's loss and gradient are sums over its datums (it scales
them itself, e.g. with ``weights``).
"""

from __future__ import annotations

from typing import ClassVar

from megatron_multilora.training.objectives.objective import Objective
from megatron_multilora.training.objectives.token_losses import (
    cross_entropy,
    importance_sampling,
    ppo,
)


class PerTokenLoss(Objective):
    name = "per_token"
    # Each loss by the name the SDK sends, and the inputs it reads per position besides the
    # target tokens (``logprobs``: the sampler's).
    LOSSES: ClassVar[dict[str, tuple[str, ...]]] = {
        "cross_entropy": ("weights",),
        "importance_sampling": ("logprobs", "advantages"),
        "ppo": ("logprobs", "advantages"),
    }

    def __init__(self, loss: str, clip_low: float = 0.2, clip_high: float = 0.2) -> None:
        """``loss``: a key of LOSSES; ``ppo`` clips the ratio to [1 - clip_low, 1 + clip_high]."""
        if loss not in self.LOSSES:
            raise ValueError(f"unknown loss {loss!r}: use one of {', '.join(self.LOSSES)}")
        self.loss, self.inputs = loss, self.LOSSES[loss]
        self._per_token = {
            "cross_entropy": lambda lp, v: cross_entropy(lp, v["weights"]),
            "importance_sampling": lambda lp, v: importance_sampling(
                lp, v["logprobs"], v["advantages"]
            ),
            "ppo": lambda lp, v: ppo(lp, v["logprobs"], v["advantages"], clip_low, clip_high),
        }[loss]

    def span_loss(self, logprobs, mask, values, sequence):
        return (self._per_token(logprobs, values) * mask).sum(), logprobs.new_zeros(0)

"""A loss over per-token inputs a client sends (the training service's objective): one of
:data:`.token_losses.TOKEN_LOSSES` by Tinker's name, summed over the datum's positions. The
sum is not normalised: as Tinker's, a client's loss and gradient are sums over its datums
(it scales them itself, e.g. with ``weights``).
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron_multilora.training.objectives.objective import Objective
from megatron_multilora.training.objectives.token_losses import TOKEN_LOSSES


class PerTokenLoss(Objective):
    name = "per_token"

    def __init__(self, loss: str, config: Mapping[str, float] | None = None) -> None:
        """``loss``: a key of TOKEN_LOSSES; ``config``: its ``loss_fn_config`` (each key it
        omits takes the loss's default)."""
        if loss not in TOKEN_LOSSES:
            raise ValueError(f"unknown loss {loss!r}: use one of {', '.join(TOKEN_LOSSES)}")
        self.loss, spec = loss, TOKEN_LOSSES[loss]
        unknown = set(config or {}) - set(spec.config)
        if unknown:
            raise ValueError(f"{loss} takes no loss_fn_config {', '.join(sorted(unknown))}")
        self.inputs = spec.inputs + spec.optional
        self.config = {**spec.config, **(config or {})}
        self._per_token = spec.per_token

    def span_loss(self, logprobs, mask, values, sequence):
        per_token = self._per_token(logprobs, values, self.config, sequence)
        return (per_token * mask).sum(), logprobs.new_zeros(0)

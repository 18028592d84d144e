"""Per-token losses on per-token inputs, named and defined as Tinker's built-in losses, so a
service can hand its clients' inputs straight to them. Each returns the per-token loss
(``[T]``); the caller weighs and sums it. ``logprobs`` are the trained policy's log-probs of
the target tokens (with gradient); every other input is a constant. Tensors' own methods
only: the module imports no torch (see :mod:`.objective`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def cross_entropy(logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``-weights * logprobs``: supervised learning on weighted target tokens."""
    return -weights * logprobs


def importance_sampling(
    logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor
) -> torch.Tensor:
    """``-exp(logprobs - sampling_logprobs) * advantages``: the policy gradient for samples
    drawn by another (the sampling) policy."""
    return -(logprobs - sampling_logprobs).exp() * advantages


def ppo(
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> torch.Tensor:
    """The clipped surrogate: ``-min(rho * A, clip(rho, 1 - clip_low, 1 + clip_high) * A)``
    with ``rho = exp(logprobs - sampling_logprobs)``."""
    ratio = (logprobs - sampling_logprobs).exp()
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -(ratio * advantages).minimum(clipped * advantages)


def kl_to_reference(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(policy || reference) per token:
    ``exp(ref - logp) - (ref - logp) - 1`` (non-negative, unbiased on policy samples)."""
    diff = ref_logprobs - logprobs
    return diff.exp() - diff - 1.0

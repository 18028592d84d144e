"""Per-token losses on per-token inputs, named and defined as Tinker's built-in losses, so a
service can hand its clients' inputs straight to them. Each returns the per-token loss
(``[T]``); the caller weighs and sums it. ``logprobs`` are the trained policy's log-probs of
the target tokens (with gradient); every other input is a constant. Tensors' own methods
only: the module imports no torch at import time (see :mod:`.objective`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
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


def segment_sums(per_token: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The float64 sum of ``per_token`` over each ``(start, end)`` span (ascending, disjoint):
    one segment reduction over the stretch the spans cover, the gaps between them its own
    segments and dropped. Each span is summed in order over its own positions, on the GPU
    too, so its sum never depends on the other spans."""
    import torch

    bounds, keep = [spans[0][0]], []
    for start, end in spans:
        if start != bounds[-1]:
            bounds.append(start)  # a gap: its own segment
        keep.append(len(bounds) - 1)
        bounds.append(end)
    lengths = torch.tensor([b - a for a, b in itertools.pairwise(bounds)], device=per_token.device)
    sums = torch.segment_reduce(
        per_token[bounds[0] : bounds[-1]].double(), "sum", lengths=lengths, unsafe=True
    )
    return sums[keep] if len(keep) < len(sums) else sums

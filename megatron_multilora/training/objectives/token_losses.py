"""Per-token losses on per-token inputs, named and defined as Tinker's built-in losses, so a
service can hand its clients' inputs straight to them. Each returns the per-token loss
(``[T]``); the caller weighs and sums it. ``logprobs`` are the trained policy's log-probs of
the target tokens (with gradient); every other input is a constant. Tensors' own methods
only: the module imports no torch at import time (see :mod:`.objective`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
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
    low: float,
    high: float,
) -> torch.Tensor:
    """The clipped surrogate: ``-min(rho * A, clip(rho, low, high) * A)`` with
    ``rho = exp(logprobs - sampling_logprobs)`` (``low``, ``high``: Tinker's
    ``clip_low_threshold`` and ``clip_high_threshold``, 0.8 and 1.2 by default)."""
    ratio = (logprobs - sampling_logprobs).exp()
    return -(ratio * advantages).minimum(ratio.clamp(low, high) * advantages)


def cispo(
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    low: float,
    high: float,
) -> torch.Tensor:
    """``-sg(clip(rho, low, high)) * logprobs * A``: the clipped ratio weighs the policy
    gradient without stopping it (Chen et al. 2025, MiniMax-M1)."""
    ratio = (logprobs.detach() - sampling_logprobs).exp()
    return -ratio.clamp(low, high) * logprobs * advantages


def dro(
    logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor, beta: float
) -> torch.Tensor:
    """``-(logprobs * A - beta / 2 * (logprobs - sampling_logprobs) ** 2)``: direct reward
    optimisation's quadratic penalty on the log-ratio (Richemond et al. 2024)."""
    return -(logprobs * advantages - 0.5 * beta * (logprobs - sampling_logprobs).square())


def gspo(
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    low: float,
    high: float,
    sequence: torch.Tensor,
    ratio_mask: torch.Tensor,
) -> torch.Tensor:
    """GSPO-token (Zheng et al. 2025): PPO's clipped surrogate on each token's copy of its
    sequence's ratio, the geometric mean of the token ratios over the positions
    ``ratio_mask`` marks, which takes each token's own log-prob gradient. ``sequence``
    ``[T]`` numbers each position's sequence (0 up); a sequence with no marked position
    has ratio 1."""
    log_ratio = (logprobs.detach() - sampling_logprobs) * ratio_mask
    sums = log_ratio.new_zeros(len(sequence)).index_add(0, sequence, log_ratio)
    counts = ratio_mask.new_zeros(len(sequence)).index_add(0, sequence, ratio_mask)
    mean = (sums / counts.clamp(min=1.0))[sequence]
    ratio = (mean + logprobs - logprobs.detach()).exp()
    return -(ratio * advantages).minimum(ratio.clamp(low, high) * advantages)


def stable_reinforce(
    logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor, cap: float
) -> torch.Tensor:
    """``-sg(min(rho, cap)) * logprobs * A``: REINFORCE weighted by the truncated importance
    ratio to the sampler (Yao et al. 2025's truncated importance sampling), which stays
    bounded however far the sampler's numerics or weights drift. Tinker documents this
    loss's sampling contract (recorded samples named by provenance) but not its objective;
    this one is ours: on policy it is importance sampling's gradient, and the service takes
    ``sampling_logprobs`` from its own record of each named sample."""
    ratio = (logprobs.detach() - sampling_logprobs).exp()
    return -ratio.clamp(max=cap) * logprobs * advantages


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

    from megatron_multilora.ops.host_values import on_device

    bounds, keep = [spans[0][0]], []
    for start, end in spans:
        if start != bounds[-1]:
            bounds.append(start)  # a gap: its own segment
        keep.append(len(bounds) - 1)
        bounds.append(end)
    lengths = on_device(
        [b - a for a, b in itertools.pairwise(bounds)], torch.int64, per_token.device
    )
    sums = torch.segment_reduce(
        per_token[bounds[0] : bounds[-1]].double(), "sum", lengths=lengths, unsafe=True
    )
    if len(keep) == len(sums):
        return sums
    return sums.index_select(0, on_device(keep, torch.int64, per_token.device))


@dataclasses.dataclass(frozen=True)
class TokenLoss:
    """A per-token loss by Tinker's name: the per-position inputs it reads besides the
    target tokens (``logprobs``: the sampler's; of these, ``optional`` a client may omit:
    the service then marks the positions with a non-zero advantage), its
    ``loss_fn_config`` keys with their defaults (each key's range: :data:`CONFIG_RANGES`),
    and the loss of each position from the trained log-probs, the inputs, the config and
    each position's sequence number. ``provenance``: it reads the sampler's log-probs from
    the service's record of the samples each datum names, not from the client."""

    inputs: tuple[str, ...]
    config: Mapping[str, float]
    per_token: Callable[..., torch.Tensor]
    optional: tuple[str, ...] = ()
    provenance: bool = False

    def config_problems(self, config: Mapping[str, float]) -> list[str]:
        """Each of ``config``'s values outside its key's range (its keys are this loss's)."""
        return [
            f"{key}={config[key]:g}: {rule}"
            for key, (rule, holds) in CONFIG_RANGES.items()
            if key in config and not holds(config[key])
        ]


# Every loss_fn_config key's range, whichever loss reads it.
CONFIG_RANGES: dict[str, tuple[str, Callable[[float], bool]]] = {
    "clip_low_threshold": ("in [0, 1]", lambda v: 0.0 <= v <= 1.0),
    "clip_high_threshold": (">= 1", lambda v: v >= 1.0),
    "beta": (">= 0", lambda v: v >= 0.0),
}


def _ratio_mask(values: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return (values["sequence_ratio_mask"] != 0).to(values["advantages"].dtype)


_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}

TOKEN_LOSSES: dict[str, TokenLoss] = {
    "cross_entropy": TokenLoss(
        ("weights",), {}, lambda lp, v, c, s: cross_entropy(lp, v["weights"])
    ),
    "importance_sampling": TokenLoss(
        ("logprobs", "advantages"),
        {},
        lambda lp, v, c, s: importance_sampling(lp, v["logprobs"], v["advantages"]),
    ),
    "ppo": TokenLoss(
        ("logprobs", "advantages"),
        _CLIP,
        lambda lp, v, c, s: ppo(
            lp, v["logprobs"], v["advantages"], c["clip_low_threshold"], c["clip_high_threshold"]
        ),
    ),
    # Tinker's CISPO clips one side by default (its loss-functions tutorial).
    "cispo": TokenLoss(
        ("logprobs", "advantages"),
        {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
        lambda lp, v, c, s: cispo(
            lp, v["logprobs"], v["advantages"], c["clip_low_threshold"], c["clip_high_threshold"]
        ),
    ),
    # Tinker documents no default beta; 0.05 is its documentation's example.
    "dro": TokenLoss(
        ("logprobs", "advantages"),
        {"beta": 0.05},
        lambda lp, v, c, s: dro(lp, v["logprobs"], v["advantages"], c["beta"]),
    ),
    # Tinker documents no default thresholds; the GSPO paper's (its section 5.1).
    "gspo": TokenLoss(
        ("logprobs", "advantages"),
        {"clip_low_threshold": 1.0 - 3e-4, "clip_high_threshold": 1.0 + 4e-4},
        lambda lp, v, c, s: gspo(
            lp,
            v["logprobs"],
            v["advantages"],
            c["clip_low_threshold"],
            c["clip_high_threshold"],
            s,
            _ratio_mask(v),
        ),
        optional=("sequence_ratio_mask",),
    ),
    "stable_reinforce": TokenLoss(
        ("logprobs", "advantages"),
        {"clip_high_threshold": 2.0},
        lambda lp, v, c, s: stable_reinforce(
            lp, v["logprobs"], v["advantages"], c["clip_high_threshold"]
        ),
        provenance=True,
    ),
}
"""Every per-token loss by the name a Tinker client sends (a GRPO job may pick the policy
losses too)."""

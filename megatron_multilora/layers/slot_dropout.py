"""Inverted dropout of the LoRA rows, each at its own slot's rate.

Rows whose values differ across TP ranks (``varies``: sharded inputs, split outputs, expert
rows) draw from megatron's tensor-parallel RNG stream; replicated rows from the default
stream, which TP ranks share, so they drop the same elements.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel


def _stream(varies: bool):
    return tensor_parallel.get_cuda_rng_tracker().fork() if varies else contextlib.nullcontext()


def dropout_by_counts(
    t: torch.Tensor, counts: Sequence[int], rates: Sequence[float], training: bool, varies: bool
) -> torch.Tensor:
    """Rows grouped by slot with host-known ``counts`` (one rate each): only the groups with a
    rate above zero draw random numbers and pay the masking passes."""
    if not training or not any(rates):
        return t
    with _stream(varies):
        pieces = [
            piece if rate == 0 else F.dropout(piece, rate)
            for rate, piece in zip(rates, t.split(list(counts)))
        ]
    return torch.cat(pieces)


def dropout_by_row(
    t: torch.Tensor, rate_of_row: torch.Tensor, training: bool, any_rate: bool, varies: bool
) -> torch.Tensor:
    """Rows in any order, ``rate_of_row`` on the device (the counts per slot are not known on
    the host, e.g. the experts' rows)."""
    if not training or not any_rate:
        return t
    p = rate_of_row.unsqueeze(1)
    with _stream(varies):
        keep = torch.rand(t.shape, device=t.device) >= p
    return t * keep.to(t.dtype) / (1.0 - p).to(t.dtype)

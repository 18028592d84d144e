"""Elementwise functions whose bits do not depend on where an element sits in its tensor.

A CPU kernel for ``exp``, ``sigmoid``, ``softplus`` or ``silu`` runs a tensor's elements
through vector code in blocks and the rest (the tail) through scalar code, and the two round
differently by an ulp. For rows narrower than a block (a Gated DeltaNet's few heads per
token) which elements land in the tail depends on how many rows come before: a job's values
would change with the jobs packed beside it. Applied to rows padded to whole blocks, every
element runs through the same vector code wherever its row is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

BLOCK = 64  # elements: two AVX-512 vectors of fp32, or of bf16 halves; a multiple of AVX2's


def lane_aligned(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn``, computed on ``x``'s last dim padded to whole
    blocks."""
    pad = -x.size(-1) % BLOCK
    if pad == 0 and x.is_contiguous():
        return fn(x)
    return fn(F.pad(x, (0, pad)))[..., : x.size(-1)]

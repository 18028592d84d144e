"""The two LoRA factors of a slot, as objects that know where their rank dimension is.

A (``linear_in``) is ``[..., r, in]``, B (``linear_out``) is ``[..., out, r]``, with a leading
local-expert dimension on expert layers; every slot is allocated at the layer's max rank and
cut to a lower one by :meth:`Factor.cut`. Where a factor is split across ranks is the
layout's business (:mod:`.sharding`).
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class Factor:
    name: str  # "A" or "B", as in the LoRA papers
    child: str  # the slot submodule holding it: "linear_in" or "linear_out"
    rank_dim: int  # -2 for A, -1 for B

    def cut(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        """``t`` (a factor, or a stack of them) cut to its first ``rank`` rank entries."""
        return t[self.rank_index(rank)]

    def rank_index(self, rank: int) -> tuple:
        return (
            (Ellipsis, slice(0, rank), slice(None))
            if self.rank_dim == -2
            else (Ellipsis, slice(0, rank))
        )

    def weight(self, slot: torch.nn.Module) -> torch.nn.Parameter:
        return getattr(slot, self.child).weight

    def __repr__(self) -> str:
        return self.name


A = Factor("A", "linear_in", -2)
B = Factor("B", "linear_out", -1)
FACTORS = (A, B)


def init_weight(method: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A fresh fp32 factor of ``shape`` drawn by ``method`` (one of
    :data:`megatron_multilora.validation.INIT_METHODS`)."""
    w = torch.empty(shape)
    if method == "xavier":
        torch.nn.init.xavier_normal_(w, generator=generator)
    elif method == "kaiming":
        torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=generator)
    elif method == "normal":
        torch.nn.init.normal_(w, std=0.02, generator=generator)
    else:
        w.zero_()
    return w

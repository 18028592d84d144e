"""Megatron's fused output rows for linears that Hugging Face keeps apart.

* ``linear_qkv``: rows ``[groups, (q_per_group + 2) * head_dim]``, each query group's q heads,
  then its k head, then its v head. E.g. 4 heads in 2 groups, head_dim 8: 64 rows
  ``q0 q1 k0 v0 | q2 q3 k1 v1`` (8 each). Tensor parallelism splits whole groups.
* a gated MLP's ``linear_fc1``: rows ``[gate; up]``; under tensor parallelism each rank holds
  ``[gate_r; up_r]``, chunk r of each half (not chunk r of the whole).

Every conversion (Hugging Face import, PEFT export/import, per-rank adapter shards) uses these,
so the layouts are written once. Trailing dims (columns, a LoRA rank) are carried along.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class QKVRows:
    """The fused q/k/v row layout of one attention layer."""

    heads: int
    groups: int
    head_dim: int

    @classmethod
    def of(cls, cfg: Any) -> QKVRows:
        """From a model config with megatron's field names (``GPTModelConfig``,
        ``TransformerConfig``): ``num_query_groups`` None means one per head, ``kv_channels``
        None means ``hidden_size // num_attention_heads``."""
        heads = cfg.num_attention_heads
        return cls(
            heads, cfg.num_query_groups or heads, cfg.kv_channels or cfg.hidden_size // heads
        )

    @property
    def q_per_group(self) -> int:
        return self.heads // self.groups

    def part_rows(self) -> tuple[int, int, int]:
        """Rows of q, k and v over all groups (Hugging Face's q_proj, k_proj, v_proj)."""
        return self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim

    def fuse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v rows of the same whole groups (all, or one TP rank's) -> fused rows."""
        d, rest = self.head_dim, q.shape[1:]
        groups = k.size(0) // d
        return torch.cat(
            [
                q.reshape(groups, self.q_per_group * d, *rest),
                k.reshape(groups, d, *rest),
                v.reshape(groups, d, *rest),
            ],
            dim=1,
        ).reshape(-1, *rest)

    def split(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`fuse`: fused rows -> (q, k, v) rows."""
        rest = fused.shape[1:]
        per_group = fused.reshape(-1, self.q_per_group + 2, self.head_dim, *rest)
        return (
            per_group[:, :-2].reshape(-1, *rest),
            per_group[:, -2].reshape(-1, *rest),
            per_group[:, -1].reshape(-1, *rest),
        )


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """fc1 rows ``[gate; up]`` (whole, or one TP rank's ``[gate_r; up_r]`` from its shards)."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_gate_up`: ``(gate, up)``."""
    gate, up = rows.chunk(2, dim=0)
    return gate, up


def shard_gate_up(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """TP rank ``rank``'s ``[gate_r; up_r]`` of the full ``[gate; up]`` rows."""
    gate, up = split_gate_up(full)
    return fuse_gate_up(gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank])


def unshard_gate_up(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`shard_gate_up`: every rank's ``[gate_r; up_r]`` in rank order ->
    the full ``[gate; up]``."""
    halves = [split_gate_up(s) for s in shards]
    return fuse_gate_up(torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves]))

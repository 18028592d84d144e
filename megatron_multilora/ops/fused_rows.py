"""Megatron's fused output rows for linears that Hugging Face keeps apart.

* ``linear_qkv``: rows ``[groups, (q_per_group + 2) * head_dim]``, each query group's q heads,
  then its k head, then its v head. E.g. 4 heads in 2 groups, head_dim 8: 64 rows
  ``q0 q1 k0 v0 | q2 q3 k1 v1`` (8 each). Tensor parallelism splits whole groups.
  With an output gate (Qwen3.5: megatron's ``attention_output_gate``) a group's gate heads
  follow its q heads: ``q0 q1 g0 g1 k0 v0 | ...``; Hugging Face's ``q_proj`` holds each head's
  q and gate rows one after the other (``q0 g0 q1 g1 ...``).
* a gated MLP's ``linear_fc1``: rows ``[gate; up]``; under tensor parallelism each rank holds
  ``[gate_r; up_r]``, chunk r of each half (not chunk r of the whole).
* a Gated DeltaNet's ``in_proj`` (:class:`DeltaNetRows`): rows per key head, its q, k, the v
  and z of its value heads, then their b and a; tensor parallelism splits whole key heads.

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
    output_gate: bool = False

    @classmethod
    def of(cls, cfg: Any) -> QKVRows:
        """From a model config with megatron's field names (``GPTModelConfig``,
        ``TransformerConfig``): ``num_query_groups`` None means one per head, ``kv_channels``
        None means ``hidden_size // num_attention_heads``."""
        heads = cfg.num_attention_heads
        return cls(
            heads,
            cfg.num_query_groups or heads,
            cfg.kv_channels or cfg.hidden_size // heads,
            bool(getattr(cfg, "attention_output_gate", False)),
        )

    @property
    def q_per_group(self) -> int:
        return self.heads // self.groups

    @property
    def q_rows_per_group(self) -> int:
        """A group's rows of Hugging Face's q_proj (its q heads, and their gates if any)."""
        return self.q_per_group * self.head_dim * (2 if self.output_gate else 1)

    def part_rows(self) -> tuple[int, int, int]:
        """Rows of q (with the gates), k and v over all groups (Hugging Face's q_proj,
        k_proj, v_proj)."""
        return self.groups * self.q_rows_per_group, *(2 * (self.groups * self.head_dim,))

    def fuse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q_proj, k, v rows of the same whole groups (all, or one TP rank's) -> fused rows."""
        d, rest = self.head_dim, q.shape[1:]
        groups = k.size(0) // d
        if self.output_gate:  # per head [q; gate] -> per group [q heads; gate heads]
            q = q.reshape(groups, self.q_per_group, 2, d, *rest).transpose(1, 2)
        return torch.cat(
            [
                q.reshape(groups, self.q_rows_per_group, *rest),
                k.reshape(groups, d, *rest),
                v.reshape(groups, d, *rest),
            ],
            dim=1,
        ).reshape(-1, *rest)

    def split(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`fuse`: fused rows -> (q_proj, k, v) rows."""
        d, rest = self.head_dim, fused.shape[1:]
        per_group = fused.reshape(-1, self.q_rows_per_group + 2 * d, *rest)
        q = per_group[:, : self.q_rows_per_group]
        if self.output_gate:
            q = q.reshape(q.size(0), 2, self.q_per_group, d, *rest).transpose(1, 2)
        k = per_group[:, self.q_rows_per_group : self.q_rows_per_group + d]
        return q.reshape(-1, *rest), k.reshape(-1, *rest), per_group[:, -d:].reshape(-1, *rest)


DELTA_NET_INPUTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
"""Hugging Face's modules of a Gated DeltaNet's fused in_proj, in :class:`DeltaNetRows`'
order of parts."""


@dataclasses.dataclass(frozen=True)
class DeltaNetRows:
    """The fused input rows of one Gated DeltaNet layer (Qwen3.5's ``in_proj_qkv``,
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` in one linear): per key head, its q and k
    (``key_dim`` each), the v then the z of its ``ratio`` value heads (``value_dim`` each),
    then their b and a (one each). Hugging Face's rows: ``in_proj_qkv`` is ``[q; k; v]`` over
    all heads, ``in_proj_z`` / ``_b`` / ``_a`` by value head; value head j belongs to key
    head ``j // ratio``."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    PARTS = ("qkv", "z", "b", "a")  # as LoRA targets name them (in_proj_<part>)

    @classmethod
    def of(cls, cfg: Any) -> DeltaNetRows:
        """From megatron's field names (``TransformerConfig``), or a ``GPTModelConfig``'s
        ``linear_attention``."""
        cfg = getattr(cfg, "linear_attention", None) or cfg
        return cls(
            cfg.linear_num_key_heads,
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
        )

    @property
    def ratio(self) -> int:
        return self.value_heads // self.key_heads

    def head_sizes(self) -> tuple[int, ...]:
        """A key head's rows: q, k, v, z, b, a."""
        r, dk, dv = self.ratio, self.key_dim, self.value_dim
        return dk, dk, r * dv, r * dv, r, r

    def part_rows(self) -> dict[str, int]:
        """Rows of each Hugging Face module over all heads."""
        kd, vd = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        return {"qkv": 2 * kd + vd, "z": vd, "b": self.value_heads, "a": self.value_heads}

    def fuse(self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """Hugging Face's rows of the same whole key heads (all, or one TP rank's) -> fused."""
        rest, heads = qkv.shape[1:], z.size(0) // (self.ratio * self.value_dim)
        kd = heads * self.key_dim
        q, k, v = qkv[:kd], qkv[kd : 2 * kd], qkv[2 * kd :]
        parts = (q, k, v, z, b, a)
        return torch.cat(
            [p.reshape(heads, n, *rest) for p, n in zip(parts, self.head_sizes())], dim=1
        ).reshape(-1, *rest)

    def split(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Inverse of :meth:`fuse`: fused rows -> (in_proj_qkv, z, b, a) rows."""
        rest = fused.shape[1:]
        per_head = fused.reshape(-1, sum(self.head_sizes()), *rest)
        q, k, v, z, b, a = (p.reshape(-1, *rest) for p in per_head.split(self.head_sizes(), dim=1))
        return torch.cat([q, k, v]), z, b, a

    def channel_spans(self, rank: int, size: int) -> list[slice]:
        """TP rank ``rank``'s rows (of ``size`` ranks) of a tensor over the q, k, v channels
        (``in_proj_qkv``, the convolution; rows ``[q; k; v]``): its key heads' q and k, and
        their value heads' v."""
        qk, v = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        spans = ((0, qk // size), (qk, qk // size), (2 * qk, v // size))
        return [slice(start + rank * n, start + (rank + 1) * n) for start, n in spans]

    def kept(self, parts: frozenset[str], rows: int) -> torch.Tensor:
        """Which of ``rows`` fused rows (whole key heads) belong to ``parts``."""
        owner = ("qkv", "qkv", "qkv", "z", "b", "a")
        head = torch.cat([torch.full((n,), p in parts) for p, n in zip(owner, self.head_sizes())])
        return head.repeat(rows // head.numel())


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

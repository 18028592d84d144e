"""The N adapter slots of one wrapped linear and everything per slot: the one object the dense
and the expert multi-LoRA layers both hold (as their ``adapters`` child).

A slot is a :class:`LoRASlot`: its two factors (each its own Parameter, what its optimizer,
gradient buffer and checkpoint keys see) and its rank, alpha and dropout as buffers, so a
saved slot carries them. The :class:`SlotBank` claims and clears slots, keeps the padded rank
of every slot at zero, holds each factor of every slot in one contiguous buffer the
Parameters are views of (:mod:`.slot_factors`), and keeps what forward reads without a
device sync: the per-slot scale ``alpha / rank`` on the device, ranks and rates on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megatron_multilora.layers.factors import FACTORS, A, B, Factor
from megatron_multilora.layers.slot_factors import SlotFactorBuffer


class FactorWeight(torch.nn.Module):
    """One factor of one slot: ``weight`` of any shape (``[r, in]``, ``[E, out, r]``, ...)."""

    def __init__(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


class LoRASlot(torch.nn.Module):
    """One adapter slot: ``linear_in`` (A), ``linear_out`` (B), and its ``rank``, ``alpha`` and
    ``dropout``. The factors are never called: the layer runs all slots at once."""

    def __init__(
        self,
        shapes: dict[Factor, tuple],
        max_rank: int,
        alpha: float,
        dropout: float,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        for factor in FACTORS:
            setattr(self, factor.child, FactorWeight(shapes[factor], dtype, device))
        self.register_buffer("rank", torch.tensor(max_rank, dtype=torch.int64, device=device))
        self.register_buffer(
            "alpha", torch.tensor(float(alpha), dtype=torch.float32, device=device)
        )
        self.register_buffer(
            "dropout", torch.tensor(float(dropout), dtype=torch.float32, device=device)
        )


class SlotBank(torch.nn.ModuleList):
    """``n`` slots of ``max_rank``, shaped ``shapes`` (this rank's shard of each factor).

    ``tag(param, factor)`` marks each factor Parameter for megatron (TP split, partial
    gradient); ``rank_offset(local_rows)`` is the first of A's rank rows this rank holds
    (A's rank dim is split in the fully sharded column layout).
    """

    def __init__(
        self,
        n: int,
        max_rank: int,
        *,
        shapes: dict[Factor, tuple],
        alpha: float,
        dropout: float,
        dtype: torch.dtype,
        device: torch.device,
        tag: Callable[[torch.nn.Parameter, Factor], None],
        rank_offset: Callable[[int], int],
        where: str,
    ) -> None:
        super().__init__(
            LoRASlot(shapes, max_rank, alpha, dropout, dtype, device) for _ in range(n)
        )
        self.max_rank, self.default_dropout, self.where = max_rank, dropout, where
        self._rank_offset = rank_offset
        self.kept_rows: torch.Tensor | None = None  # B's rows an adapter may use (None: all)
        for slot in self:
            for factor in FACTORS:
                tag(factor.weight(slot), factor)
        # Not module state: each slot's Parameters stay its own (keys, optimizers, grads).
        self.factor_buffers = {f: SlotFactorBuffer(self.params(f), f) for f in FACTORS}
        self.register_buffer(
            "scale", torch.zeros(n, dtype=torch.float32, device=device), persistent=False
        )
        self.register_buffer(
            "dropout_p", torch.zeros(n, dtype=torch.float32, device=device), persistent=False
        )
        self.refresh()

    def check(self, idx: int) -> None:
        if not 0 <= idx < len(self):
            raise IndexError(f"{self.where}: slot {idx} is out of range 0..{len(self) - 1}")

    def params(
        self, factor: Factor, slots: Sequence[int] | None = None
    ) -> list[torch.nn.Parameter]:
        """``factor``'s Parameters of ``slots`` (default: every slot)."""
        return [factor.weight(self[i]) for i in (range(len(self)) if slots is None else slots)]

    def stack(
        self, factor: Factor, slots: tuple[int, ...], rank: int
    ) -> tuple[torch.Tensor, Callable[[], torch.Tensor] | None]:
        """``factor`` of ``slots`` cut to ``rank``, ``[G, ..., r, in]`` / ``[G, ..., out, r]``,
        read from the slot buffer; and how to rebuild it in backward when it is a copy."""
        return self.factor_buffers[factor].gather(slots, self.params(factor, slots), rank)

    def claim(self, idx: int, rank: int, alpha: float, dropout: float | None = None) -> None:
        """Bind slot ``idx``'s rank, alpha (and dropout) and zero its padded rank."""
        self.check(idx)
        if not isinstance(rank, int) or not 1 <= rank <= self.max_rank:
            raise ValueError(
                f"{self.where}: rank={rank} is outside 1..{self.max_rank} (the "
                "layer's max rank dim)"
            )
        if dropout is not None and not 0.0 <= dropout < 1.0:
            raise ValueError(f"{self.where}: dropout={dropout} must be in [0, 1)")
        self.restore(idx, rank, alpha, self.rates[idx] if dropout is None else dropout)
        self.mask_rank(idx)

    def release(self, idx: int) -> None:
        """Free slot ``idx``: zero alpha, max rank, the layer's default dropout (the caller
        re-initialises its weights)."""
        self.check(idx)
        self.restore(idx, self.max_rank, 0.0, self.default_dropout)

    def restore(self, idx: int, rank: int, alpha: float, dropout: float) -> None:
        """Set slot ``idx``'s rank, alpha and dropout as known on the host (nothing read
        back from the device): its weights are put there by the caller (a paged-in adapter's
        rows, already masked to its rank)."""
        slot = self[idx]
        slot.rank.fill_(rank)
        slot.alpha.fill_(float(alpha))
        slot.dropout.fill_(float(dropout))
        # The values as the fp32 buffers hold them (what a state-dict load reads back), and
        # alpha / rank as the buffers divide it (fp32 by an integer), computed on the host.
        alpha32, dropout32 = (torch.tensor(float(v), dtype=torch.float32) for v in (alpha, dropout))
        with torch.no_grad():
            self.scale[idx] = alpha32 / rank
            self.dropout_p[idx] = dropout32
        self.ranks[idx], self.rates[idx] = int(rank), float(dropout32)
        self.alphas[idx] = float(alpha32)

    def load(self, idx: int, factors: dict[Factor, torch.Tensor]) -> None:
        """Copy this rank's shards into slot ``idx`` and re-zero its padded rank."""
        with torch.no_grad():
            for factor, value in factors.items():
                factor.weight(self[idx]).copy_(value)
        self.mask_rank(idx)

    def mask_rank(self, idx: int) -> None:
        """Zero A's rank rows and B's rank columns beyond the slot's rank (B's rank dim is
        never split; A's is in the fully sharded column layout), and B's rows outside
        ``kept_rows``."""
        slot, r = self[idx], int(self[idx].rank)
        a, b = A.weight(slot), B.weight(slot)
        first = self._rank_offset(a.size(-2))
        with torch.no_grad():
            a[..., max(0, min(a.size(-2), r - first)) :, :].zero_()
            b[..., r:].zero_()
            if self.kept_rows is not None:
                b.masked_fill_(~self.kept_rows.unsqueeze(-1), 0.0)

    def refresh(self) -> None:
        """Per-slot alpha/rank and dropout for forward, read once here so forward needs no
        device-to-host sync to skip dropout or to pick the rank it computes at (every slot:
        after a state-dict load; :meth:`claim` and :meth:`release` refresh their own)."""
        self.ranks, self.rates, self.alphas = [0] * len(self), [0.0] * len(self), [0.0] * len(self)
        for i in range(len(self)):
            self._refresh_slot(i)

    def _refresh_slot(self, i: int) -> None:
        slot = self[i]
        with torch.no_grad():
            self.scale[i] = slot.alpha / slot.rank
            self.dropout_p[i] = slot.dropout
        self.ranks[i], self.rates[i] = int(slot.rank), float(slot.dropout)
        self.alphas[i] = float(slot.alpha)

    def compute_rank(self, slots: tuple[int, ...], rank_is_split: bool) -> int:
        """The rank the GEMMs run at: the largest rank among ``slots`` that have alpha != 0
        (padded rank rows are zero, so computing fewer changes nothing), rounded up to a
        multiple of 8 so the ``[tokens, r]`` buffer keeps the grouped kernel's alignment."""
        if rank_is_split:
            return self.max_rank
        r = max((self.ranks[i] for i in slots if self.alphas[i] != 0.0), default=1)
        return min(self.max_rank, -(-r // 8) * 8)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        if hasattr(self, "factor_buffers"):  # a conversion gave the Parameters new data
            for factor, buffer in self.factor_buffers.items():
                buffer.realias(self.params(factor))
        return self

"""``MultiLoRAGroupedExpertLinear``: N LoRA slots on a grouped MoE expert linear.

One low-rank pair per (slot, local expert): A ``[E, r, in]`` and B ``[E, out, r]`` per
slot. For a dispatched row t of slot s routed to local expert e::

    y_t = W_e x_t + (alpha_s / r_s) * B_{s,e}[:, :r_s] @ A_{s,e}[:r_s] @ x_t

Rows reach the experts in the dispatcher's expert-major order, mixed across EP ranks, so the
slot token counts cannot segment them; the MoE layer's routing hook
(:mod:`megatron_multilora.layers.slot_routing`) supplies, per forward, the permutation that
sorts rows by (slot, expert). The LoRA term is then :func:`.multi_lora_linear.lora_term` over
``N * E`` groups. Expert weights are never tensor-split (expert tensor parallel size 1):
factors are split over expert-parallel ranks by whole experts
(:class:`~.expert_sharding.ExpertParallelLayout`) and tagged ``allreduce=False`` like megatron's expert
weights. The slots and their lifecycle are the dense layer's (a :class:`~.slot_bank.SlotBank`).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_multilora.deprecation import renamed_arguments
from megatron_multilora.layers.expert_sharding import ExpertParallelLayout
from megatron_multilora.layers.factors import A, B
from megatron_multilora.layers.multi_lora_linear import (
    MultiLoRALinear,
    Stack,
    lora_term,
)
from megatron_multilora.layers.slot_dropout import dropout_by_row
from megatron_multilora.layers.tp_layout import owns_output


class MultiLoRAGroupedExpertLinear(MultiLoRALinear):
    """Grouped expert linear (``experts.linear_fc1``/``linear_fc2``) with N LoRA slots.

    ``to_wrap`` has TE's grouped-linear interface: ``forward(x, m_splits)`` and one
    ``weight{i}`` ``[out, in]`` per local expert. Other arguments as :class:`MultiLoRALinear`;
    ``num_local_experts`` must match the base, ``expert_offset`` is the global index of this
    rank's first expert. ``routing`` is set by the MoE layer's hook before every forward.
    """

    @renamed_arguments(n_adapters="n_slots", dim="max_rank")
    def __init__(
        self,
        to_wrap: torch.nn.Module,
        n_slots: int,
        max_rank: int,
        alpha: float,
        full_name: str,
        num_local_experts: int,
        column_init_method: str = "xavier",
        row_init_method: str = "zero",
        dropout: float = 0.0,
        dropout_position: str = "pre",
        expert_offset: int = 0,
        seed: int = 1234,
    ) -> None:
        self._experts = (num_local_experts, expert_offset)  # for _layout, called first
        super().__init__(
            to_wrap,
            n_slots,
            max_rank,
            alpha,
            full_name,
            column_init_method,
            row_init_method,
            dropout,
            dropout_position,
            seed=seed,
        )
        self.routing = None

    def _layout(
        self,
        to_wrap: torch.nn.Module,
        sequence_parallel: bool | None,
        fully_sharded: bool,
        gated_output: bool,
        max_rank: int,
        where: str,
    ) -> ExpertParallelLayout:
        """The factors split over expert-parallel ranks by whole experts; the base must hold
        this rank's ``num_local_experts``."""
        num_local_experts, expert_offset = self._experts
        gemms = getattr(to_wrap, "num_gemms", None)
        if gemms != num_local_experts:
            raise ValueError(
                f"{where}: the base has num_gemms={gemms}, expected "
                f"num_local_experts={num_local_experts}"
            )
        return ExpertParallelLayout(num_local_experts, expert_offset)

    @property
    def num_local_experts(self) -> int:
        return self.tp_layout.num_local_experts

    def forward(self, x: torch.Tensor, m_splits: Any, *args: Any, **kwargs: Any) -> Any:
        out, bias = self.to_wrap(x, m_splits, *args, **kwargs)
        routing = self.routing
        if routing is None or routing.num_tokens != x.size(0):
            raise RuntimeError(
                f"{self.where}: no slot routing for {x.size(0)} dispatched rows; "
                "install_moe_slot_routing(model) must run (it is called by apply_multi_lora) "
                "and a slot layout be given (packed_seq_params or set_tokens_per_adapter_slot) "
                "before forward"
            )
        if not routing.slots:
            return out, bias
        bank, seg = self.adapters, routing.segments
        xs = x.index_select(0, routing.sort_idx)  # rows grouped by (slot, expert)
        rate_of_row, any_rate = bank.dropout_p[seg.label_of_row], any(bank.rates)
        if self.dropout_position == "pre":
            xs = dropout_by_row(xs, rate_of_row, self.training, any_rate, True)
        r = bank.compute_rank(routing.slots, False)
        lora = lora_term(
            xs,
            self._expert_stack(A, routing.slots, r),
            self._expert_stack(B, routing.slots, r),
            seg,
            lambda rows: seg,
            bank.scale,
            lambda mid: mid,
        )
        if self.dropout_position == "post":
            lora = dropout_by_row(lora, rate_of_row, self.training, any_rate, True)
        lora = self.masked(lora)
        if owns_output(out):  # scatter back in place: no unpermuted copy of the LoRA term
            return out.index_add_(0, routing.sort_idx, lora), bias
        return out + lora.index_select(0, routing.inverse_idx), bias

    def _expert_stack(self, factor, slots: tuple[int, ...], r: int) -> Stack:
        """``factor`` of ``slots`` as ``[slots * E, ...]`` groups, and its rebuild."""
        w, rebuild = self.adapters.stack(factor, slots, r)
        return w.flatten(0, 1), None if rebuild is None else (lambda: rebuild().flatten(0, 1))

    def extra_repr(self) -> str:
        return (
            f"n_slots={self.n_slots}, max_rank={self.max_rank}, "
            f"num_local_experts={self.num_local_experts}"
        )

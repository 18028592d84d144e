"""``MultiLoRAGroupedExpertLinear``: N LoRA slots on a grouped MoE expert linear.

One low-rank pair per (slot, local expert): A ``[E, dim, in]`` and B ``[E, out, dim]`` per
slot. For a dispatched row t of slot s routed to local expert e::

    y_t = W_e x_t + (alpha_s / r_s) * B_{s,e}[:, :r_s] @ A_{s,e}[:r_s] @ x_t

Rows reach the experts in the dispatcher's expert-major order, mixed across EP ranks, so the
slot token counts cannot segment them; the MoE layer's routing hook
(:mod:`megatron_multilora.layers.slot_routing`) supplies, per forward, the permutation that
sorts rows by (slot, expert). The LoRA term is then two grouped GEMMs over ``N * E`` groups.
Expert weights are never tensor-split (expert tensor parallel size 1), so factors are only
expert-parallel: they are tagged ``allreduce=False`` like megatron's expert weights.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from megatron.core import parallel_state, tensor_parallel

from megatron_multilora.layers.grouped_gemm import grouped_linear
from megatron_multilora.layers.multi_lora_linear import (
    MultiLoRALinear,
    _init_weight,
    all_gather_list,
    owns_output,
    register_slot_buffers,
)
from megatron_multilora.layers.sharding import Sharding


class GroupedFactor(torch.nn.Module):
    """One LoRA factor for every local expert: ``weight`` ``[experts, rows, cols]``."""

    def __init__(self, experts: int, rows: int, cols: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(experts, rows, cols, dtype=dtype, device=device))


class ExpertLoRASlot(torch.nn.Module):
    """One adapter slot of an expert linear: ``linear_in`` (A), ``linear_out`` (B), rank, alpha."""

    def __init__(self, experts: int, in_features: int, out_features: int, dim: int, alpha: float,
                 dropout: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.linear_in = GroupedFactor(experts, dim, in_features, dtype, device)
        self.linear_out = GroupedFactor(experts, out_features, dim, dtype, device)
        register_slot_buffers(self, dim, alpha, dropout)


class MultiLoRAGroupedExpertLinear(MultiLoRALinear):
    """Grouped expert linear (``experts.linear_fc1``/``linear_fc2``) with N LoRA slots.

    ``to_wrap`` has TE's grouped-linear interface: ``forward(x, m_splits)`` and one
    ``weight{i}`` ``[out, in]`` per local expert. Other arguments as :class:`MultiLoRALinear`;
    ``num_local_experts`` must match the base. ``routing`` is set by the MoE layer's hook
    before every forward.
    """

    def __init__(self, to_wrap: torch.nn.Module, n_adapters: int, dim: int, alpha: float,
                 full_name: str, num_local_experts: int, column_init_method: str = "xavier",
                 row_init_method: str = "zero", dropout: float = 0.0,
                 dropout_position: str = "pre", gated_output: bool = False,
                 expert_offset: int = 0, seed: int = 1234) -> None:
        self.num_local_experts = num_local_experts
        self.expert_offset = expert_offset
        self.routing = None
        super().__init__(to_wrap, n_adapters, dim, alpha, full_name, column_init_method,
                         row_init_method, dropout, dropout_position, gated_output=gated_output,
                         seed=seed)

    def _check_base(self, to_wrap: torch.nn.Module, where: str) -> None:
        gemms = getattr(to_wrap, "num_gemms", None)
        if gemms != self.num_local_experts:
            raise ValueError(f"{where}: the base has num_gemms={gemms}, expected "
                             f"num_local_experts={self.num_local_experts}")

    def _sharding(self, to_wrap: torch.nn.Module, sequence_parallel: Optional[bool],
                  fully_sharded: bool) -> Sharding:
        return Sharding("replicated", 1, 0, False, None)

    def _new_slot(self, alpha: float) -> ExpertLoRASlot:
        weight = self.to_wrap.weight0
        out_f, in_f = weight.shape
        slot = ExpertLoRASlot(self.num_local_experts, in_f, out_f, self.dim, alpha, self.dropout,
                              weight.dtype, weight.device)
        for p in slot.parameters():
            # Expert-parallel: reduced over the expert-data-parallel group (megatron DDP and
            # training/grad_sync.py both read this tag).
            p.allreduce = False
            self._tag(p, None, False)
        return slot

    def reset_adapter(self, idx: int, init_key: Optional[str] = None) -> None:
        """Re-initialise slot ``idx``: each expert's factors drawn by its *global* index, so
        the adapter does not depend on the expert-parallel layout."""
        self._check_idx(idx)
        slot = self.adapters[idx]
        with torch.no_grad():
            for e in range(self.num_local_experts):
                gen = self._generator(idx if init_key is None else init_key,
                                      self.expert_offset + e)
                for factor, method in ((slot.linear_in, self.column_init_method),
                                       (slot.linear_out, self.row_init_method)):
                    factor.weight[e].copy_(_init_weight(method, tuple(factor.weight.shape[1:]), gen))
        self._apply_rank_mask(idx)

    def full_shape(self, factor: str) -> tuple[int, ...]:
        """The shape of factor ``"A"`` or ``"B"`` over all experts of every EP rank."""
        slot = self.adapters[0]
        shape = list((slot.linear_in if factor == "A" else slot.linear_out).weight.shape)
        shape[0] *= parallel_state.get_expert_model_parallel_world_size()
        return tuple(shape)

    def local_shard(self, factor: str, full: torch.Tensor) -> torch.Tensor:
        """This EP rank's local experts of a factor over all experts."""
        ep = parallel_state.get_expert_model_parallel_world_size()
        return full.chunk(ep, dim=0)[parallel_state.get_expert_model_parallel_rank()]

    def gather_full(self, factor: str, local: torch.Tensor) -> torch.Tensor:
        """A factor over all experts from this EP rank's local experts (inverse of
        :meth:`local_shard`); collective over the expert-parallel group."""
        group = parallel_state.get_expert_model_parallel_group()
        if torch.distributed.get_world_size(group) == 1:
            return local
        return torch.cat(all_gather_list(local, group))

    def _dropout(self, t: torch.Tensor, slot_of_row: torch.Tensor, tp_sharded: bool) -> torch.Tensor:
        """Inverted dropout of ``t``'s rows, in the dispatcher's order, each at its slot's
        rate (``slot_of_row`` is on the device: the counts per slot are not known on the host).
        Expert rows differ across ranks, so they draw from megatron's tensor-parallel stream."""
        if not self.training or not any(self._rates):
            return t
        p = self.dropout_p[slot_of_row].unsqueeze(1)
        with tensor_parallel.get_cuda_rng_tracker().fork() if tp_sharded else contextlib.nullcontext():
            keep = torch.rand(t.shape, device=t.device) >= p
        return t * keep.to(t.dtype) / (1.0 - p).to(t.dtype)

    def forward(self, x: torch.Tensor, m_splits: Any, *args: Any, **kwargs: Any) -> Any:
        out, bias = self.to_wrap(x, m_splits, *args, **kwargs)
        routing = self.routing
        if routing is None or routing.num_tokens != x.size(0):
            raise RuntimeError(
                f"MultiLoRAGroupedExpertLinear({self.full_name}): no slot routing for "
                f"{x.size(0)} dispatched rows; install_moe_slot_routing(model) must run (it is "
                "called by apply_multi_lora) and a slot layout be given (packed_seq_params or "
                "set_tokens_per_adapter_slot) before forward")
        slots = routing.slots
        if not slots:
            return out, bias
        xs = x.index_select(0, routing.sort_idx)          # rows grouped by (slot, expert)
        slot_of_row = routing.segments.label_of_row
        if self.dropout_position == "pre":
            xs = self._dropout(xs, slot_of_row, tp_sharded=True)
        r, seg = self._compute_rank(slots), routing.segments
        # [slots * E, ...] factors (see MultiLoRALinear._lora).
        a, rebuild_a = self._expert_factors("A", slots, r)
        mid = grouped_linear(xs, a, seg, rebuild_w=rebuild_a)                    # [T, r]
        mid = (mid.float() * self.scale[slot_of_row].unsqueeze(1)).to(mid.dtype)
        b, rebuild_b = self._expert_factors("B", slots, r)
        lora = grouped_linear(mid, b, seg, rebuild_w=rebuild_b)                  # [T, out]
        if self.dropout_position == "post":
            lora = self._dropout(lora, slot_of_row, tp_sharded=True)
        if owns_output(out):  # scatter back in place: no unpermuted copy of the LoRA term
            return out.index_add_(0, routing.sort_idx, lora), bias
        return out + lora.index_select(0, routing.inverse_idx), bias

    def _expert_factors(self, factor: str, slots: tuple[int, ...], r: int):
        """The factors of ``slots`` as ``[slots * E, ...]`` groups, and their rebuild."""
        w, rebuild = self._slot_factors(factor, slots, r)
        return w.flatten(0, 1), None if rebuild is None else (lambda: rebuild().flatten(0, 1))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """The base's expert weights as the base lays them out, plus each adapter tensor as
        this EP rank's slice (local experts) of one tensor over all experts."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from megatron.core.transformer.utils import sharded_state_dict_default

        sharded = sharded_state_dict_default(self.to_wrap, prefix, sharded_offsets, metadata)
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        ep_size = parallel_state.get_expert_model_parallel_world_size()
        edp_rank = parallel_state.get_expert_data_parallel_rank()
        for name, child in self.named_children():
            if child is self.to_wrap:
                continue
            for key, value in child.state_dict(prefix=f"{name}.", keep_vars=True).items():
                if value.dim() == 3:  # [local experts, ...] slice of [all experts, ...]
                    offsets = (*sharded_offsets, (len(sharded_offsets), ep_rank, ep_size))
                    sharded[prefix + key] = ShardedTensor.from_rank_offsets(
                        prefix + key, value, *offsets, replica_id=(0, 0, edp_rank),
                        prepend_axis_num=len(sharded_offsets))
                else:  # rank and alpha: the same everywhere, saved by global rank 0
                    sharded[prefix + key] = ShardedTensor.from_rank_offsets(
                        prefix + key, value, *sharded_offsets,
                        replica_id=(0, 0, torch.distributed.get_rank()),
                        prepend_axis_num=len(sharded_offsets))
        return sharded

    def extra_repr(self) -> str:
        return (f"n_adapters={self.n_adapters}, dim={self.dim}, "
                f"num_local_experts={self.num_local_experts}")

"""The layout of a grouped expert linear's LoRA factors: whole experts over the
expert-parallel ranks."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from megatron_multilora.layers.factors import A, B, Factor, init_weight
from megatron_multilora.layers.tp_layout import Generators, TPLayout, all_gather_list


class ExpertParallelLayout(TPLayout):
    """A grouped expert linear's factors ``[local experts, ...]``: whole experts split over
    the expert-parallel ranks, never over TP (expert tensor parallel size 1)."""

    def __init__(self, num_local_experts: int, expert_offset: int) -> None:
        super().__init__()
        self.num_local_experts, self.expert_offset = num_local_experts, expert_offset

    def split_dim(self, factor: Factor) -> int | None:
        return 0

    def slot_shapes(self, base: torch.nn.Module, max_rank: int) -> dict[Factor, tuple]:
        out, inp = base.weight0.shape
        e = self.num_local_experts
        return {A: (e, max_rank, inp), B: (e, out, max_rank)}

    def draw(
        self,
        methods: dict[Factor, str],
        local_shapes: dict[Factor, tuple],
        generator: Generators,
        key: object,
    ) -> dict[Factor, torch.Tensor]:
        """Each expert's factors from a generator seeded by ``key`` and the expert's *global*
        index, so the adapter does not depend on the expert-parallel layout."""
        out = {f: torch.empty(local_shapes[f]) for f in methods}
        for e in range(self.num_local_experts):
            gen = generator(key, self.expert_offset + e)
            for f, method in methods.items():
                out[f][e] = init_weight(method, tuple(local_shapes[f][1:]), gen)
        return out

    def tag(self, param: torch.nn.Parameter, factor: Factor) -> None:
        # Reduced over the expert-data-parallel group (megatron DDP and grad_sync read it).
        param.allreduce = False
        set_tensor_model_parallel_attributes(param, False, 0, 1)
        param.sequence_parallel = False

    def _ranks(self) -> int:
        return parallel_state.get_expert_model_parallel_world_size()

    def _rank(self) -> int:
        return parallel_state.get_expert_model_parallel_rank()

    def _group(self) -> Any:
        return parallel_state.get_expert_model_parallel_group()

    def gather(self, factor: Factor, local: torch.Tensor) -> torch.Tensor:
        return local if self._ranks() == 1 else torch.cat(all_gather_list(local, self._group()))

    def varies(self, side: str) -> bool:
        return True  # expert rows differ across ranks

    def sharded_state_dict(
        self,
        factor_of: dict,
        tensors: dict,
        prefix: str,
        sharded_offsets: tuple,
        metadata: dict | None,
    ) -> dict:
        """Each factor as this EP rank's slice (local experts) of one tensor over all experts;
        rank and alpha, the same everywhere, saved by global rank 0."""
        ep_rank, ep_size = self._rank(), self._ranks()
        edp_rank = parallel_state.get_expert_data_parallel_rank()
        out = {}
        for key, value in tensors.items():
            if value.dim() == 3:
                offsets = (*sharded_offsets, (len(sharded_offsets), ep_rank, ep_size))
                replica = (0, 0, edp_rank)
            else:
                offsets, replica = sharded_offsets, (0, 0, torch.distributed.get_rank())
            out[prefix + key] = ShardedTensor.from_rank_offsets(
                prefix + key,
                value,
                *offsets,
                replica_id=replica,
                prepend_axis_num=len(sharded_offsets),
            )
        return out

    def __repr__(self) -> str:
        return f"ExpertParallelLayout(num_local_experts={self.num_local_experts})"

"""Where each LoRA factor lives under tensor parallelism, per kind of wrapped base linear.

For ``y = base(x) + s * B @ (A @ x)`` with A ``[r, in]`` and B ``[out, r]``, the default
layout:

==============  ======================  =====================  ==============================
base            A                       B                      collective on ``mid = A @ x``
==============  ======================  =====================  ==============================
column-parallel replicated ``[r, in]``  split on out           SP: all-gather rows (bwd
                                        ``[out/tp, r]``        reduce-scatter); else identity
                                                               (bwd all-reduce)
row-parallel    split on in             replicated             SP: reduce-scatter rows (bwd
                ``[r, in/tp]``          ``[out, r]``           all-gather); else all-reduce
replicated      replicated              replicated             none
==============  ======================  =====================  ==============================

Fully sharded (S-LoRA) layout: no factor is replicated, so adapter memory, optimizer state
and the LoRA GEMMs divide by the TP size. The layer then runs the base's matmul itself so
that the base's own collective also completes the LoRA term:

==============  ======================  =====================  ==============================
base            A                       B                      collectives
==============  ======================  =====================  ==============================
column-parallel split on rank           split on out           all-gather of ``mid``'s rank
                ``[r/tp, in]``          ``[out/tp, r]``        columns (bwd reduce-scatter);
                                                               the LoRA input gradient joins
                                                               the base's input all-reduce
                                                               (SP: reduce-scatter)
row-parallel    split on in             split on out           all-reduce of ``mid`` (fwd and
                ``[r, in/tp]``          ``[out/tp, r]``        bwd); the LoRA output is added
                                                               into this rank's columns of
                                                               the base's partial sum before
                                                               the base's all-reduce (SP:
                                                               reduce-scatter)
==============  ======================  =====================  ==============================

Each collective moves only the small ``[tokens, r]`` buffer, once per layer whatever the
number of slots. Factors whose gradient is a partial sum over this rank's sequence shard
(replicated ones under SP) are tagged ``sequence_parallel`` like megatron's norm weights, so
megatron's ``finalize_model_grads`` (or :mod:`megatron_multilora.training.grad_sync`) sums
them across TP ranks; fully sharded factors never are.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.tensor_parallel import mappings


@dataclasses.dataclass(frozen=True)
class Sharding:
    """The TP layout of one wrapped linear (see the module docstring)."""

    kind: str  # "column" | "row" | "replicated"
    tp_size: int
    tp_rank: int
    sequence_parallel: bool
    group: object
    fully_sharded: bool = False  # only in effect with tp_size > 1 and a column/row base

    @property
    def sharded_lora(self) -> bool:
        """The fully sharded layout is in effect (the layer runs the base's matmul itself)."""
        return self.fully_sharded and self.tp_size > 1 and self.kind != "replicated"

    @property
    def a_split_dim(self) -> int | None:
        if self.tp_size == 1 or self.kind == "replicated":
            return None
        if self.kind == "row":
            return 1
        return 0 if self.sharded_lora else None

    @property
    def b_split_dim(self) -> int | None:
        if self.tp_size == 1 or self.kind == "replicated":
            return None
        return 0 if self.kind == "column" or self.sharded_lora else None

    @property
    def rank_is_split(self) -> bool:
        """A's rank rows are split over TP ranks (fully sharded column-parallel)."""
        return self.a_split_dim == 0

    @property
    def input_is_sequence_shard(self) -> bool:
        """The LoRA input holds this rank's sequence window, not the whole micro-batch."""
        return (self.sequence_parallel and self.kind in ("column", "replicated")
                and not self.sharded_lora)

    @property
    def output_is_sequence_shard(self) -> bool:
        return (self.sequence_parallel and self.kind in ("row", "replicated")
                and not self.sharded_lora)

    @property
    def input_is_tp_sharded(self) -> bool:
        """Different TP ranks hold different LoRA-input values (dropout must differ too)."""
        return self.kind == "row" or self.input_is_sequence_shard

    @property
    def output_is_tp_sharded(self) -> bool:
        """Different TP ranks hold different LoRA-output values."""
        return self.output_is_sequence_shard or self.kind == "column" or self.sharded_lora

    def partial_grad_factors(self) -> tuple[bool, bool]:
        """(A, B): whose gradient is a partial sum over this rank's sequence shard."""
        if not (self.sequence_parallel and self.tp_size > 1) or self.sharded_lora:
            return False, False
        return {"column": (True, False), "row": (False, True), "replicated": (True, True)}[self.kind]

    def reduce_mid(self, mid: torch.Tensor) -> torch.Tensor:
        """The one TP collective on ``mid = A @ x``, matching the base's output layout."""
        if self.tp_size == 1 or self.kind == "replicated":
            return mid
        if self.sharded_lora:
            if self.kind == "column":  # [T, r/tp] -> [T, r]; bwd sums the partial gradients
                return mappings.all_gather_last_dim_from_tensor_parallel_region(mid, group=self.group)
            # Row: every rank needs the full sum (B is split on out), and every rank's B slice
            # contributes to its gradient: all-reduce both ways.
            mid = mappings.reduce_from_tensor_model_parallel_region(mid, group=self.group)
            return mappings.copy_to_tensor_model_parallel_region(mid, group=self.group)
        if self.kind == "column":
            if self.sequence_parallel:
                return mappings.gather_from_sequence_parallel_region(
                    mid, tensor_parallel_output_grad=True, group=self.group)
            return mappings.copy_to_tensor_model_parallel_region(mid, group=self.group)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(mid, group=self.group)
        return mappings.reduce_from_tensor_model_parallel_region(mid, group=self.group)

    def base_input(self, x: torch.Tensor) -> torch.Tensor:
        """Fully sharded column-parallel: the base's own input collective, run here so the
        LoRA branch's (partial) input gradient is summed by it too."""
        if self.sequence_parallel:
            return mappings.gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=True, group=self.group)
        return mappings.copy_to_tensor_model_parallel_region(x, group=self.group)

    def base_output(self, partial: torch.Tensor) -> torch.Tensor:
        """Fully sharded row-parallel: the base's own reduction of its partial sums (which
        now carry this rank's LoRA output columns too)."""
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(partial, group=self.group)
        return mappings.reduce_from_tensor_model_parallel_region(partial, group=self.group)

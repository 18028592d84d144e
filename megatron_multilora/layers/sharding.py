"""Where each LoRA factor lives under tensor parallelism, per kind of wrapped base linear.

For ``y = base(x) + s * B @ (A @ x)`` with A ``[r, in]`` and B ``[out, r]``:

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

Each collective moves only the small ``[tokens, r]`` buffer, once per layer whatever the
number of slots. Factors whose gradient is a partial sum over this rank's sequence shard
(replicated ones under SP) are tagged ``sequence_parallel`` like megatron's norm weights, so
megatron's ``finalize_model_grads`` sums them across TP ranks.
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

    @property
    def a_split_dim(self) -> int | None:
        return 1 if self.kind == "row" and self.tp_size > 1 else None

    @property
    def b_split_dim(self) -> int | None:
        return 0 if self.kind == "column" and self.tp_size > 1 else None

    @property
    def input_is_sequence_shard(self) -> bool:
        """The LoRA input holds this rank's sequence window, not the whole micro-batch."""
        return self.sequence_parallel and self.kind in ("column", "replicated")

    @property
    def output_is_sequence_shard(self) -> bool:
        return self.sequence_parallel and self.kind in ("row", "replicated")

    @property
    def input_is_tp_sharded(self) -> bool:
        """Different TP ranks hold different LoRA-input values (dropout must differ too)."""
        return self.kind == "row" or self.input_is_sequence_shard

    def partial_grad_factors(self) -> tuple[bool, bool]:
        """(A, B): whose gradient is a partial sum over this rank's sequence shard."""
        if not (self.sequence_parallel and self.tp_size > 1):
            return False, False
        return {"column": (True, False), "row": (False, True), "replicated": (True, True)}[self.kind]

    def reduce_mid(self, mid: torch.Tensor) -> torch.Tensor:
        """The one TP collective on ``mid = A @ x``, matching the base's output layout."""
        if self.tp_size == 1 or self.kind == "replicated":
            return mid
        if self.kind == "column":
            if self.sequence_parallel:
                return mappings.gather_from_sequence_parallel_region(
                    mid, tensor_parallel_output_grad=True, group=self.group)
            return mappings.copy_to_tensor_model_parallel_region(mid, group=self.group)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(mid, group=self.group)
        return mappings.reduce_from_tensor_model_parallel_region(mid, group=self.group)

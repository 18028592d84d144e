"""Where each LoRA factor lives, per kind of wrapped base linear: one layout object each.

For ``y = base(x) + s * B @ (A @ x)`` with A ``[r, in]`` and B ``[out, r]``, the default
layouts:

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

Fully sharded (S-LoRA) layouts: no factor is replicated, so adapter memory, optimizer state
and the LoRA GEMMs divide by the TP size. The layout then runs the base's matmul itself so
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

Expert linears are never tensor-split: their factors ``[experts, ...]`` are split over the
expert-parallel ranks by whole experts (:class:`ExpertParallelLayout`).

Each collective moves only the small ``[tokens, r]`` buffer, once per layer whatever the
number of slots. Factors whose gradient is a partial sum over this rank's sequence shard
(replicated ones under SP) are tagged ``sequence_parallel`` like megatron's norm weights, so
megatron's ``finalize_model_grads`` (or :mod:`megatron_multilora.training.step.grad_sync`)
sums them across TP ranks; fully sharded factors never are.
"""

from __future__ import annotations

import enum
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_multilora.layers.factors import A, B, Factor
from megatron_multilora.layers.tp_layout import BaseCall, TPLayout, add_lora


class BaseKind(enum.Enum):
    """How a wrapped base's weight is split over TP."""

    COLUMN = "column"  # on its output dim (linear_qkv, linear_fc1)
    ROW = "row"  # on its input dim (linear_proj, linear_fc2)
    REPLICATED = "replicated"  # whole on every rank


_TE_KINDS = {
    "TEColumnParallelLinear": BaseKind.COLUMN,
    "TELayerNormColumnParallelLinear": BaseKind.COLUMN,
    "TERowParallelLinear": BaseKind.ROW,
}


class _SplitLikeTheBase(TPLayout):
    """A base split over TP (column: on out, row: on in): one factor is split like the base's
    weight, the other replicated; the TP collective on ``mid`` matches the base's output.
    Subclasses are rows of the table above: which factor is split (and on which dim), the
    side of the LoRA that is split, and the collective with and without SP."""

    split: tuple[Factor, int]
    split_side: str  # "input" or "output": the side that is this rank's slice of the features
    collective: staticmethod
    sp_collective: staticmethod

    def split_dim(self, factor: Factor) -> int | None:
        return self.split[1] if factor is self.split[0] and self.tp_size > 1 else None

    def sequence_shard(self, side: str) -> bool:
        return self.sequence_parallel and side != self.split_side

    def varies(self, side: str) -> bool:
        return side == self.split_side or self.sequence_shard(side)

    def partial_grad(self, factor: Factor) -> bool:
        return self.sequence_parallel and factor is not self.split[0]  # the replicated one

    def reduce_mid(self, mid: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return mid
        collective = self.sp_collective if self.sequence_parallel else self.collective
        return collective(mid, group=self.group)


class ColumnParallelLayout(_SplitLikeTheBase):
    """B split on out like the base's weight; A replicated."""

    split, split_side = (B, 0), "output"
    collective = staticmethod(mappings.copy_to_tensor_model_parallel_region)
    sp_collective = staticmethod(
        partial(mappings.gather_from_sequence_parallel_region, tensor_parallel_output_grad=True)
    )


class RowParallelLayout(_SplitLikeTheBase):
    """A split on in like the base's weight; B replicated."""

    split, split_side = (A, 1), "input"
    collective = staticmethod(mappings.reduce_from_tensor_model_parallel_region)
    sp_collective = staticmethod(mappings.reduce_scatter_to_sequence_parallel_region)


class _FullySharded:
    """No factor is replicated, so none has a partial (SP) gradient, and the LoRA term
    always sees whole sequences: the layout runs the base's collectives itself."""

    def sequence_shard(self, side: str) -> bool:
        return False

    def partial_grad(self, factor: Factor) -> bool:
        return False

    def call_base(
        self,
        base: torch.nn.Module,
        x: torch.Tensor,
        args: tuple,
        kwargs: dict,
        returns_ln_output: bool,
        where: str,
    ) -> BaseCall:
        """The base's matmul run here (:meth:`_matmul`): it takes only its input; its bias
        is added to the output, or handed back (megatron's ``skip_bias_add``)."""
        if args or kwargs:
            raise TypeError(
                f"{where}: a fully sharded layer takes only its input, got extra "
                f"arguments {args} {sorted(kwargs)}"
            )
        add_bias, returned_bias = (None, base.bias) if base.skip_bias_add else (base.bias, None)
        return self._matmul(base.weight, x, add_bias, returned_bias)


class FullyShardedColumnLayout(_FullySharded, ColumnParallelLayout):
    """A split on rank too: ``mid``'s rank columns are all-gathered; the base's input
    collective, run here, also sums the LoRA branch's input gradient."""

    rank_is_split = True

    def split_dim(self, factor: Factor) -> int | None:
        return 0

    def rank_offset(self, local_rows: int) -> int:
        return self.tp_rank * local_rows

    def slot_shapes(self, base: torch.nn.Module, max_rank: int) -> dict[Factor, tuple]:
        out, inp = base.weight.shape
        return {A: (max_rank // self.tp_size, inp), B: (out, max_rank)}

    def reduce_mid(self, mid: torch.Tensor) -> torch.Tensor:
        # [T, r/tp] -> [T, r]; bwd sums the partial gradients
        return mappings.all_gather_last_dim_from_tensor_parallel_region(mid, group=self.group)

    def _matmul(self, weight: torch.Tensor, x: torch.Tensor, add_bias: Any, bias: Any) -> BaseCall:
        # The base's input collective, run here so that its backward also sums the LoRA
        # branch's input gradient, is the one the column layout takes on ``mid``.
        x_full = super().reduce_mid(x)
        out = F.linear(x_full, weight, add_bias)

        def output(lora: torch.Tensor | None) -> Any:
            return (out if lora is None else add_lora(out, lora.view_as(out))), bias

        return BaseCall(x_full.reshape(-1, x_full.size(-1)), False, False, output)


class FullyShardedRowLayout(_FullySharded, RowParallelLayout):
    """B split on out too: this rank's LoRA output columns are added into its partial sum of
    the base's output before the base's own reduction, which completes both."""

    def split_dim(self, factor: Factor) -> int | None:
        return 1 if factor is A else 0

    def slot_shapes(self, base: torch.nn.Module, max_rank: int) -> dict[Factor, tuple]:
        out, inp = base.weight.shape  # the base's output is not split, B is
        return {A: (max_rank, inp), B: (out // self.tp_size, max_rank)}

    def varies(self, side: str) -> bool:
        return True  # the input is split on in, the LoRA output is this rank's columns

    def reduce_mid(self, mid: torch.Tensor) -> torch.Tensor:
        # Every rank needs the full sum (B is split on out), and every rank's B slice
        # contributes to its gradient: all-reduce both ways.
        mid = mappings.reduce_from_tensor_model_parallel_region(mid, group=self.group)
        return mappings.copy_to_tensor_model_parallel_region(mid, group=self.group)

    def _matmul(self, weight: torch.Tensor, x: torch.Tensor, add_bias: Any, bias: Any) -> BaseCall:
        x2 = x.reshape(-1, x.size(-1))
        partial = F.linear(x2, weight)  # [T, out]: this rank's partial sum

        def output(lora: torch.Tensor | None) -> Any:
            if lora is not None:  # [T, out/tp]: this rank's columns
                width = lora.size(1)
                partial[:, self.tp_rank * width : (self.tp_rank + 1) * width] += lora
            # The base's own reduction (SP: reduce-scatter), the row layout's collective on
            # ``mid``.
            out = RowParallelLayout.reduce_mid(self, partial.view(*x.shape[:-1], partial.size(-1)))
            return (out if add_bias is None else out + add_bias), bias

        return BaseCall(x2, False, False, output)


def base_kind(to_wrap: torch.nn.Module) -> BaseKind:
    """How the base's weight is split over TP."""
    if isinstance(to_wrap, ColumnParallelLinear):
        return BaseKind.COLUMN
    if isinstance(to_wrap, RowParallelLinear):
        return BaseKind.ROW
    kind = _TE_KINDS.get(type(to_wrap).__name__)
    if kind is not None:
        return kind
    if (
        isinstance(to_wrap, torch.nn.Linear)
        or getattr(to_wrap, "parallel_mode", "") == "duplicated"
    ):
        return BaseKind.REPLICATED
    raise TypeError(
        f"MultiLoRALinear cannot wrap {type(to_wrap).__name__}: supported bases are megatron's "
        "ColumnParallelLinear/RowParallelLinear, TE's (LayerNorm)ColumnParallelLinear/"
        "RowParallelLinear and TP-replicated linears"
    )


def dense_layout(
    to_wrap: torch.nn.Module,
    sequence_parallel: bool | None,
    fully_sharded: bool,
    gated: bool,
    max_rank: int,
    where: str,
) -> TPLayout:
    """The layout of a wrapped dense base under the current TP group (checked)."""
    kind = base_kind(to_wrap)
    sp = getattr(to_wrap, "sequence_parallel", None)
    if kind is BaseKind.REPLICATED and sequence_parallel is not None:
        # A replicated base's own flag misleads: TE runs a duplicated TELinear (MLA's
        # down-projections) at TP 1, so it says False, yet under SP it reads this rank's
        # sequence shard. The model's flag says where its input lives.
        sp = sequence_parallel
    sp = bool(sequence_parallel) if sp is None else sp
    group = getattr(to_wrap, "tp_group", None)
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    tp = torch.distributed.get_world_size(group) if group is not None else 1
    rank = torch.distributed.get_rank(group) if group is not None else 0
    sharded = fully_sharded and tp > 1 and kind is not BaseKind.REPLICATED
    if sharded:
        _check_fully_sharded(to_wrap, kind, tp, max_rank, where)
    cls = {
        (BaseKind.COLUMN, False): ColumnParallelLayout,
        (BaseKind.ROW, False): RowParallelLayout,
        (BaseKind.REPLICATED, False): TPLayout,
        (BaseKind.COLUMN, True): FullyShardedColumnLayout,
        (BaseKind.ROW, True): FullyShardedRowLayout,
    }[kind, sharded]
    return cls(tp, rank, group, sp, gated)


def _check_fully_sharded(
    to_wrap: torch.nn.Module, kind: BaseKind, tp: int, max_rank: int, where: str
) -> None:
    if not isinstance(to_wrap, (ColumnParallelLinear, RowParallelLinear)):
        raise ValueError(
            f"{where}: fully_sharded=True needs megatron's ColumnParallelLinear/"
            f"RowParallelLinear base, got {type(to_wrap).__name__} (TE linears run their "
            "collectives inside TE): build the model with the local (non-TE) spec or use "
            "fully_sharded=False"
        )
    if kind is BaseKind.COLUMN and max_rank % tp:
        raise ValueError(
            f"{where}: fully_sharded=True splits the rank dim over {tp} TP ranks; "
            f"max_rank={max_rank} must be a multiple of it"
        )
    if kind is BaseKind.ROW and to_wrap.weight.size(0) % tp:
        raise ValueError(
            f"{where}: fully_sharded=True splits B's {to_wrap.weight.size(0)} output "
            f"rows over {tp} TP ranks: they must divide evenly"
        )

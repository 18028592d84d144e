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
expert-parallel ranks by whole experts (:class:`ExpertParallel`).

Each collective moves only the small ``[tokens, r]`` buffer, once per layer whatever the
number of slots. Factors whose gradient is a partial sum over this rank's sequence shard
(replicated ones under SP) are tagged ``sequence_parallel`` like megatron's norm weights, so
megatron's ``finalize_model_grads`` (or :mod:`megatron_multilora.training.step.grad_sync`)
sums them across TP ranks; fully sharded factors never are.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_multilora.layers.factors import A, B, Factor, init_weight
from megatron_multilora.ops.fused_rows import shard_gate_up, unshard_gate_up

# generator(*key): the layer's CPU generator for one slot's draws (see MultiLoRALinear)
Generators = Callable[..., torch.Generator]
_TE_KINDS = {"TEColumnParallelLinear": "column", "TELayerNormColumnParallelLinear": "column",
             "TERowParallelLinear": "row"}


def all_gather_list(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``t`` (the same shape on every rank of ``group``), in rank order."""
    parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return parts


def owns_output(t: torch.Tensor) -> bool:
    """Whether a base's output ``t`` may take the LoRA term in place: a tensor of its own (a
    view may alias the base's input, e.g. a TP=1 all-reduce returns its input) that is not
    a leaf autograd tracks. An output that autograd saved would fail backward's version check
    rather than give wrong gradients; linear ops save their inputs, not their output."""
    return not t._is_view() and (t.grad_fn is not None or not t.requires_grad)


def add_lora(base_out: torch.Tensor, lora: torch.Tensor) -> torch.Tensor:
    """``base_out + lora``, into ``base_out`` when it is safe: no second ``[tokens, out]``
    tensor (its gradient passes through to both either way)."""
    return base_out.add_(lora) if owns_output(base_out) else base_out + lora


class Layout:
    """A TP-replicated base (or any base at TP=1 that is neither column- nor row-parallel),
    and what every layout answers: where each factor is split, how a full factor is
    sharded and gathered, which collective ``mid`` takes, and how the LoRA term meets the
    base's output."""

    kind = "replicated"
    rank_is_split = False  # A's rank rows split over the ranks (then computed at max rank)

    def __init__(self, tp_size: int = 1, tp_rank: int = 0, group: Any = None,
                 sequence_parallel: bool = False, gated: bool = False) -> None:
        self.tp_size, self.tp_rank, self.group = tp_size, tp_rank, group
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.gated = gated  # a gated fc1: B's rows are [gate; up] within each TP shard

    # ----- factors ------------------------------------------------------------------------

    def split_dim(self, factor: Factor) -> Optional[int]:
        """The dim of ``factor`` split over this layout's ranks (None: replicated)."""
        return None

    def slot_shapes(self, base: torch.nn.Module, max_rank: int) -> dict[Factor, tuple]:
        """This rank's shape of each factor of one slot."""
        out, inp = base.weight.shape
        return {A: (max_rank, inp), B: (out, max_rank)}

    def rank_offset(self, local_rows: int) -> int:
        """The first of A's rank rows this rank holds (of ``local_rows`` per rank)."""
        return 0

    def full_shape(self, factor: Factor, local_shape: tuple) -> tuple:
        shape, dim = list(local_shape), self.split_dim(factor)
        if dim is not None:
            shape[dim] *= self._ranks()
        return tuple(shape)

    def shard(self, factor: Factor, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of an unsharded factor."""
        dim = self.split_dim(factor)
        if dim is None:
            return full
        if factor is B and self.gated:
            return shard_gate_up(full, self.tp_rank, self.tp_size)  # [gate_r; up_r]
        return full.chunk(self._ranks(), dim=dim)[self._rank()]

    def gather(self, factor: Factor, local: torch.Tensor) -> torch.Tensor:
        """The unsharded factor from this rank's shard (collective when it is split)."""
        dim = self.split_dim(factor)
        if dim is None:
            return local
        parts = all_gather_list(local, self._group())
        return unshard_gate_up(parts) if factor is B and self.gated else torch.cat(parts, dim=dim)

    def draw(self, methods: dict[Factor, str], local_shapes: dict[Factor, tuple],
             generator: Generators, key: object) -> dict[Factor, torch.Tensor]:
        """A slot's initial factors: each drawn whole (A, then B) from one generator seeded
        by ``key`` and sharded, so they do not depend on the layout."""
        gen = generator(key)
        return {f: self.shard(f, init_weight(method, self.full_shape(f, local_shapes[f]), gen))
                for f, method in methods.items()}

    def tag(self, param: torch.nn.Parameter, factor: Factor) -> None:
        """megatron's attributes on a factor Parameter: TP split, partial (SP) gradient."""
        dim = self.split_dim(factor)
        set_tensor_model_parallel_attributes(param, dim is not None, 0 if dim is None else dim, 1)
        param.sequence_parallel = self.partial_grad(factor)

    def _ranks(self) -> int:
        return self.tp_size

    def _rank(self) -> int:
        return self.tp_rank

    def _group(self) -> Any:
        return self.group

    # ----- activations --------------------------------------------------------------------

    @property
    def input_is_sequence_shard(self) -> bool:
        """The LoRA input holds this rank's sequence window, not the whole micro-batch."""
        return self.sequence_parallel

    @property
    def output_is_sequence_shard(self) -> bool:
        return self.sequence_parallel

    @property
    def input_varies(self) -> bool:
        """TP ranks hold different LoRA-input values (its dropout draws from the TP stream)."""
        return self.input_is_sequence_shard

    @property
    def output_varies(self) -> bool:
        return self.output_is_sequence_shard

    def partial_grad(self, factor: Factor) -> bool:
        """Whether ``factor``'s gradient is a partial sum over this rank's sequence shard."""
        return self.sequence_parallel

    def reduce_mid(self, mid: torch.Tensor) -> torch.Tensor:
        """The one TP collective on ``mid = A @ x``, matching the base's output layout."""
        return mid

    def forward(self, layer: Any, x: torch.Tensor, slots: tuple[int, ...], args: tuple,
                kwargs: dict) -> Any:
        """The base's output plus the LoRA term of ``slots`` (``layer.lora``)."""
        result = layer.to_wrap(x, *args, **kwargs)
        # Megatron/TE linears return (output, bias); plain torch linears a tensor.
        base_out, bias = result if isinstance(result, tuple) else (result, None)
        if layer.returns_ln_output:  # TE hands the normalised input, what LoRA reads, back
            base_out, x = base_out
        if slots:
            lora = layer.lora(x.reshape(-1, x.size(-1)), slots, self.input_is_sequence_shard,
                              self.output_is_sequence_shard)
            base_out = add_lora(base_out, lora.view_as(base_out))
        return (base_out, bias) if isinstance(result, tuple) else base_out

    def sharded_state_dict(self, factor_of: dict, tensors: dict, prefix: str,
                           sharded_offsets: tuple, metadata: Optional[dict]) -> dict:
        """megatron dist-checkpointing view of the adapter ``tensors`` (keys without
        ``prefix``; ``factor_of`` maps a factor Parameter to its :class:`Factor`), with their
        TP split axes, so checkpoints reshard across TP layouts."""
        axes, gated = {}, []
        for key, value in tensors.items():
            factor = factor_of.get(value)
            if factor is not None and self.split_dim(factor) is not None:
                axes[key] = self.split_dim(factor)
                if factor is B and self.gated:
                    gated.append(prefix + key)
        out = make_sharded_tensors_for_checkpoint(tensors, prefix, axes, sharded_offsets)
        singleton = (metadata or {}).get("singleton_local_shards", False)
        for key in gated:  # B rows are [gate; up] per rank, as the base's fc1 weight
            out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, singleton)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tp={self.tp_size}, sequence_parallel={self.sequence_parallel})"


class ColumnParallel(Layout):
    """B split on out like the base's weight; A replicated."""

    kind = "column"

    def split_dim(self, factor: Factor) -> Optional[int]:
        return 0 if factor is B and self.tp_size > 1 else None

    @property
    def output_is_sequence_shard(self) -> bool:
        return False

    @property
    def output_varies(self) -> bool:
        return True

    def partial_grad(self, factor: Factor) -> bool:
        return self.sequence_parallel and factor is A

    def reduce_mid(self, mid: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return mid
        if self.sequence_parallel:
            return mappings.gather_from_sequence_parallel_region(
                mid, tensor_parallel_output_grad=True, group=self.group)
        return mappings.copy_to_tensor_model_parallel_region(mid, group=self.group)


class RowParallel(Layout):
    """A split on in like the base's weight; B replicated."""

    kind = "row"

    def split_dim(self, factor: Factor) -> Optional[int]:
        return 1 if factor is A and self.tp_size > 1 else None

    @property
    def input_is_sequence_shard(self) -> bool:
        return False

    @property
    def input_varies(self) -> bool:
        return True

    def partial_grad(self, factor: Factor) -> bool:
        return self.sequence_parallel and factor is B

    def reduce_mid(self, mid: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return mid
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(mid, group=self.group)
        return mappings.reduce_from_tensor_model_parallel_region(mid, group=self.group)


class FullyShardedColumn(ColumnParallel):
    """A split on rank too: ``mid``'s rank columns are all-gathered; the base's input
    collective, run here, also sums the LoRA branch's input gradient."""

    rank_is_split = True

    def split_dim(self, factor: Factor) -> Optional[int]:
        return 0

    def rank_offset(self, local_rows: int) -> int:
        return self.tp_rank * local_rows

    def slot_shapes(self, base: torch.nn.Module, max_rank: int) -> dict[Factor, tuple]:
        out, inp = base.weight.shape
        return {A: (max_rank // self.tp_size, inp), B: (out, max_rank)}

    @property
    def input_is_sequence_shard(self) -> bool:
        return False

    def partial_grad(self, factor: Factor) -> bool:
        return False

    def reduce_mid(self, mid: torch.Tensor) -> torch.Tensor:
        # [T, r/tp] -> [T, r]; bwd sums the partial gradients
        return mappings.all_gather_last_dim_from_tensor_parallel_region(mid, group=self.group)

    def forward(self, layer: Any, x: torch.Tensor, slots: tuple[int, ...], args: tuple,
                kwargs: dict) -> Any:
        base = _plain_call(layer, args, kwargs)
        add_bias = None if base.skip_bias_add else base.bias
        if self.sequence_parallel:
            x_full = mappings.gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=True, group=self.group)
        else:
            x_full = mappings.copy_to_tensor_model_parallel_region(x, group=self.group)
        out = F.linear(x_full, base.weight, add_bias)
        if slots:
            out = add_lora(out, layer.lora(x_full.reshape(-1, x_full.size(-1)), slots, False,
                                           False).view_as(out))
        return out, base.bias if base.skip_bias_add else None


class FullyShardedRow(RowParallel):
    """B split on out too: this rank's LoRA output columns are added into its partial sum of
    the base's output before the base's own reduction, which completes both."""

    def split_dim(self, factor: Factor) -> Optional[int]:
        return 1 if factor is A else 0

    def slot_shapes(self, base: torch.nn.Module, max_rank: int) -> dict[Factor, tuple]:
        out, inp = base.weight.shape  # the base's output is not split, B is
        return {A: (max_rank, inp), B: (out // self.tp_size, max_rank)}

    @property
    def output_is_sequence_shard(self) -> bool:
        return False

    @property
    def output_varies(self) -> bool:
        return True

    def partial_grad(self, factor: Factor) -> bool:
        return False

    def reduce_mid(self, mid: torch.Tensor) -> torch.Tensor:
        # Every rank needs the full sum (B is split on out), and every rank's B slice
        # contributes to its gradient: all-reduce both ways.
        mid = mappings.reduce_from_tensor_model_parallel_region(mid, group=self.group)
        return mappings.copy_to_tensor_model_parallel_region(mid, group=self.group)

    def forward(self, layer: Any, x: torch.Tensor, slots: tuple[int, ...], args: tuple,
                kwargs: dict) -> Any:
        base = _plain_call(layer, args, kwargs)
        add_bias = None if base.skip_bias_add else base.bias
        x2 = x.reshape(-1, x.size(-1))
        partial = F.linear(x2, base.weight)  # [T, out]: this rank's partial sum
        if slots:
            lora = layer.lora(x2, slots, False, False)  # [T, out/tp]: this rank's columns
            width = lora.size(1)
            partial[:, self.tp_rank * width:(self.tp_rank + 1) * width] += lora
        partial = partial.view(*x.shape[:-1], partial.size(-1))
        if self.sequence_parallel:
            out = mappings.reduce_scatter_to_sequence_parallel_region(partial, group=self.group)
        else:
            out = mappings.reduce_from_tensor_model_parallel_region(partial, group=self.group)
        return (out if add_bias is None else out + add_bias), base.bias if base.skip_bias_add else None


def _plain_call(layer: Any, args: tuple, kwargs: dict) -> torch.nn.Module:
    if args or kwargs:
        raise TypeError(f"{layer.where}: a fully sharded layer takes only its input, got extra "
                        f"arguments {args} {sorted(kwargs)}")
    return layer.to_wrap


class ExpertParallel(Layout):
    """A grouped expert linear's factors ``[local experts, ...]``: whole experts split over
    the expert-parallel ranks, never over TP (expert tensor parallel size 1)."""

    kind = "experts"

    def __init__(self, num_local_experts: int, expert_offset: int) -> None:
        super().__init__()
        self.num_local_experts, self.expert_offset = num_local_experts, expert_offset

    def split_dim(self, factor: Factor) -> Optional[int]:
        return 0

    def slot_shapes(self, base: torch.nn.Module, max_rank: int) -> dict[Factor, tuple]:
        out, inp = base.weight0.shape
        e = self.num_local_experts
        return {A: (e, max_rank, inp), B: (e, out, max_rank)}

    def draw(self, methods: dict[Factor, str], local_shapes: dict[Factor, tuple],
             generator: Generators, key: object) -> dict[Factor, torch.Tensor]:
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

    @property
    def input_varies(self) -> bool:
        return True  # expert rows differ across ranks

    @property
    def output_varies(self) -> bool:
        return True

    def sharded_state_dict(self, factor_of: dict, tensors: dict, prefix: str,
                           sharded_offsets: tuple, metadata: Optional[dict]) -> dict:
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
                prefix + key, value, *offsets, replica_id=replica,
                prepend_axis_num=len(sharded_offsets))
        return out

    def __repr__(self) -> str:
        return f"ExpertParallel(num_local_experts={self.num_local_experts})"


def base_kind(to_wrap: torch.nn.Module) -> str:
    """``"column"``, ``"row"`` or ``"replicated"``: how the base's weight is split over TP."""
    if isinstance(to_wrap, ColumnParallelLinear):
        return "column"
    if isinstance(to_wrap, RowParallelLinear):
        return "row"
    kind = _TE_KINDS.get(type(to_wrap).__name__)
    if kind is not None:
        return kind
    if isinstance(to_wrap, torch.nn.Linear) or getattr(to_wrap, "parallel_mode", "") == "duplicated":
        return "replicated"
    raise TypeError(
        f"MultiLoRALinear cannot wrap {type(to_wrap).__name__}: supported bases are megatron's "
        "ColumnParallelLinear/RowParallelLinear, TE's (LayerNorm)ColumnParallelLinear/"
        "RowParallelLinear and TP-replicated linears")


def dense_layout(to_wrap: torch.nn.Module, sequence_parallel: Optional[bool],
                 fully_sharded: bool, gated: bool, max_rank: int, where: str) -> Layout:
    """The layout of a wrapped dense base under the current TP group (checked)."""
    kind = base_kind(to_wrap)
    sp = getattr(to_wrap, "sequence_parallel", None)
    sp = bool(sequence_parallel) if sp is None else sp
    group = getattr(to_wrap, "tp_group", None)
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    tp = torch.distributed.get_world_size(group) if group is not None else 1
    rank = torch.distributed.get_rank(group) if group is not None else 0
    sharded = fully_sharded and tp > 1 and kind != "replicated"
    if sharded:
        _check_fully_sharded(to_wrap, kind, tp, max_rank, where)
    cls = {("column", False): ColumnParallel, ("row", False): RowParallel,
           ("replicated", False): Layout, ("column", True): FullyShardedColumn,
           ("row", True): FullyShardedRow}[kind, sharded]
    return cls(tp, rank, group, sp, gated)


def _check_fully_sharded(to_wrap: torch.nn.Module, kind: str, tp: int, max_rank: int,
                         where: str) -> None:
    if not isinstance(to_wrap, (ColumnParallelLinear, RowParallelLinear)):
        raise ValueError(
            f"{where}: fully_sharded=True needs megatron's ColumnParallelLinear/"
            f"RowParallelLinear base, got {type(to_wrap).__name__} (TE linears run their "
            "collectives inside TE): build the model with the local (non-TE) spec or use "
            "fully_sharded=False")
    if kind == "column" and max_rank % tp:
        raise ValueError(f"{where}: fully_sharded=True splits the rank dim over {tp} TP ranks; "
                         f"dim={max_rank} must be a multiple of it")
    if kind == "row" and to_wrap.weight.size(0) % tp:
        raise ValueError(f"{where}: fully_sharded=True splits B's {to_wrap.weight.size(0)} output "
                         f"rows over {tp} TP ranks: they must divide evenly")

"""What a layout is: where a LoRA slot's factors live across ranks and how its LoRA term
meets the wrapped base's output. :class:`TPLayout` is the TP-replicated base and the questions
every layout answers; the TP layouts are in :mod:`.sharding`, the experts' in
:mod:`.expert_sharding`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_multilora.layers.factors import A, B, Factor, init_weight
from megatron_multilora.ops.fused_rows import shard_gate_up, unshard_gate_up

# generator(*key): the layer's CPU generator for one slot's draws (see MultiLoRALinear)
Generators = Callable[..., torch.Generator]


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


@dataclasses.dataclass
class BaseCall:
    """A wrapped base called on one input (:meth:`TPLayout.call_base`): the rows the LoRA
    term reads (``[T, in]``), whether its input and output sides hold this rank's sequence
    shard, and ``output(lora)``: the layer's result with the LoRA term (``[T, out]`` rows,
    or None) added where the layout adds it."""

    rows: torch.Tensor
    in_shard: bool
    out_shard: bool
    output: Callable[[torch.Tensor | None], Any]


class TPLayout:
    """A TP-replicated base (or any base at TP=1 that is neither column- nor row-parallel),
    and what every layout answers: where each factor is split, how a full factor is
    sharded and gathered, which collective ``mid`` takes, and how the LoRA term meets the
    base's output (:meth:`call_base`; the layer computes the term itself)."""

    rank_is_split = False  # A's rank rows split over the ranks (then computed at max rank)

    def __init__(
        self,
        tp_size: int = 1,
        tp_rank: int = 0,
        group: Any = None,
        sequence_parallel: bool = False,
        gated: bool = False,
    ) -> None:
        self.tp_size, self.tp_rank, self.group = tp_size, tp_rank, group
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.gated = gated  # a gated fc1: B's rows are [gate; up] within each TP shard

    # ----- factors ------------------------------------------------------------------------

    def split_dim(self, factor: Factor) -> int | None:
        """The dim of ``factor`` split over this layout's ranks (None: replicated)."""
        return None

    def slot_shapes(self, base: torch.nn.Module, max_rank: int) -> dict[Factor, tuple]:
        """This rank's shape of each factor of one slot."""
        out, inp = base_shape(base)
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

    def draw(
        self,
        methods: dict[Factor, str],
        local_shapes: dict[Factor, tuple],
        generator: Generators,
        key: object,
    ) -> dict[Factor, torch.Tensor]:
        """A slot's initial factors: each drawn whole (A, then B) from one generator seeded
        by ``key`` and sharded, so they do not depend on the layout."""
        gen = generator(key)
        return {
            f: self.shard(f, init_weight(method, self.full_shape(f, local_shapes[f]), gen))
            for f, method in methods.items()
        }

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

    def sequence_shard(self, side: str) -> bool:
        """The LoRA ``side`` ("input" or "output") holds this rank's sequence window, not the
        whole micro-batch."""
        return self.sequence_parallel

    def varies(self, side: str) -> bool:
        """TP ranks hold different values on that side (its dropout draws from the TP
        stream)."""
        return self.sequence_shard(side)

    def partial_grad(self, factor: Factor) -> bool:
        """Whether ``factor``'s gradient is a partial sum over this rank's sequence shard."""
        return self.sequence_parallel

    def reduce_mid(self, mid: torch.Tensor) -> torch.Tensor:
        """The one TP collective on ``mid = A @ x``, matching the base's output layout."""
        return mid

    def call_base(
        self,
        base: torch.nn.Module,
        x: torch.Tensor,
        args: tuple,
        kwargs: dict,
        returns_ln_output: bool,
        where: str,
    ) -> BaseCall:
        """The base called on ``x``: what the LoRA term reads and how it meets the output."""
        result = base(x, *args, **kwargs)
        # Megatron/TE linears return (output, bias); plain torch linears a tensor.
        base_out, bias = result if isinstance(result, tuple) else (result, None)
        if returns_ln_output:  # TE hands the normalised input, what LoRA reads, back
            base_out, x = base_out

        def output(lora: torch.Tensor | None) -> Any:
            out = base_out if lora is None else add_lora(base_out, lora.view_as(base_out))
            return (out, bias) if isinstance(result, tuple) else out

        rows = x.reshape(-1, x.size(-1))
        return BaseCall(rows, self.sequence_shard("input"), self.sequence_shard("output"), output)

    def sharded_state_dict(
        self,
        factor_of: dict,
        tensors: dict,
        prefix: str,
        sharded_offsets: tuple,
        metadata: dict | None,
    ) -> dict:
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
        return (
            f"{type(self).__name__}(tp={self.tp_size}, sequence_parallel={self.sequence_parallel})"
        )


def base_shape(base: torch.nn.Module) -> tuple[int, int]:
    """This rank's ``(out, in)`` of the base's weight; an output layer tied to the embedding
    (no weight of its own) has megatron's partition sizes."""
    if getattr(base, "weight", None) is not None:
        return tuple(base.weight.shape)
    return base.output_size_per_partition, base.input_size

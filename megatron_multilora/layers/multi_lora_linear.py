"""``MultiLoRALinear``: a Megatron parallel linear with N concurrent LoRA adapter slots.

For a token t of slot s (LoRA, Hu et al. 2021, with per-slot rank and alpha)::

    y_t = base(x_t) + (alpha_s / r_s) * B_s[:, :r_s] @ A_s[:r_s] @ x_t

Every slot is allocated at the max rank ``dim``; rows ``[r_s:]`` of A_s and columns
``[:, r_s:]`` of B_s are kept at zero, so padded rank never contributes and its gradients
stay zero. A packed micro-batch holds each slot's tokens contiguously (adapter-major);
its ``packed_seq_params`` (:mod:`.micro_batch_layout`) or ``set_tokens_per_adapter_slot``
say how many. The forward is two grouped GEMMs over those
slot segments with one TP collective on the small ``[tokens, dim]`` buffer between them
(layout per base kind in :mod:`.sharding`). The per-slot scale is applied in fp32 to that
small buffer, as serving kernels apply it, rather than to the full ``[tokens, out]`` output.
Only the slots with tokens in the micro-batch take part, at the largest rank among them:
an idle slot costs no GEMM work and gets no gradient, and a padded rank is not computed.
Each factor of every slot lives in one contiguous ``[N, ...]`` buffer that the slots'
Parameters are views of (:mod:`.slot_factors`), so the GEMMs read the active slots' factors
without stacking them; the LoRA term is added into the base's output in place when the
layer owns that tensor.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import (
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)

from megatron_multilora.layers.grouped_gemm import Segments, grouped_linear
from megatron_multilora.layers.sharding import Sharding
from megatron_multilora.layers.slot_factors import SlotFactorBuffer
from megatron_multilora.layers.slot_tokens import SlotTokens
from megatron_multilora.ops.fused_rows import shard_gate_up, unshard_gate_up

_INIT_METHODS = ("xavier", "kaiming", "normal", "zero")
_TE_KINDS = {
    "TEColumnParallelLinear": "column",
    "TELayerNormColumnParallelLinear": "column",
    "TERowParallelLinear": "row",
}


class LoRASlot(torch.nn.Module):
    """One adapter slot: ``linear_in`` (A, ``[dim, in]``), ``linear_out`` (B, ``[out, dim]``).

    Shapes are this TP rank's shards (A holds ``dim / rank_shards`` rank rows when the rank
    dim is split). ``rank``, ``alpha`` and ``dropout`` are buffers so that a saved slot
    carries them. The two linears are never called: the layer runs all slots at
    once.
    """

    def __init__(self, in_features: int, out_features: int, dim: int, alpha: float,
                 dropout: float, dtype: torch.dtype, device: torch.device,
                 rank_shards: int = 1) -> None:
        super().__init__()
        self.linear_in = torch.nn.Linear(in_features, dim // rank_shards, bias=False, dtype=dtype,
                                         device=device)
        self.linear_out = torch.nn.Linear(dim, out_features, bias=False, dtype=dtype, device=device)
        register_slot_buffers(self, dim, alpha, dropout)


def register_slot_buffers(slot: torch.nn.Module, dim: int, alpha: float, dropout: float) -> None:
    """The per-slot hyperparameters every slot module carries (saved with the slot)."""
    slot.register_buffer("rank", torch.tensor(dim, dtype=torch.int64))
    slot.register_buffer("alpha", torch.tensor(float(alpha), dtype=torch.float32))
    slot.register_buffer("dropout", torch.tensor(float(dropout), dtype=torch.float32))


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


def all_gather_list(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``t`` (the same shape on every rank of ``group``), in rank order."""
    parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return parts


def _init_weight(method: str, shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    w = torch.empty(shape)
    if method == "xavier":
        torch.nn.init.xavier_normal_(w, generator=generator)
    elif method == "kaiming":
        torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=generator)
    elif method == "normal":
        torch.nn.init.normal_(w, std=0.02, generator=generator)
    else:
        w.zero_()
    return w


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


class MultiLoRALinear(torch.nn.Module):
    """Megatron parallel linear wrapped with ``n_adapters`` concurrent LoRA slots.

    Args:
        to_wrap: the frozen base linear; ``forward`` returns what it returns, plus LoRA.
        n_adapters: number of slots N.
        dim: max rank; every slot is allocated at this rank.
        alpha: initial alpha of every slot (per-slot values via ``init_adapter_slot``).
        full_name: the module's path in the model, used in errors and to seed init.
        column_init_method / row_init_method: init of A / B ("xavier", "kaiming",
            "normal", "zero"); B at zero makes a fresh adapter a no-op.
        dropout / dropout_position: dropout on the LoRA input ("pre") or output ("post");
            ``dropout`` is every slot's initial rate (per-slot via ``init_adapter_slot``).
        a2a_experimental: accepted for API compatibility; only False is supported.
        sequence_parallel: for bases that do not carry the flag themselves (plain
            replicated linears); megatron and TE bases use their own.
        gated_output: the base is a gated MLP's fc1, whose output is ``[gate; up]`` within
            each TP rank's shard; B's rows follow that layout in checkpoints.
        seed: base seed of the deterministic, layout-independent slot initialisation.
        fully_sharded: under TP, shard every factor (S-LoRA; layouts in :mod:`.sharding`):
            A on its rank dim (column-parallel bases) or B on its output dim (row-parallel
            bases); needs megatron's own ColumnParallelLinear/RowParallelLinear bases, whose
            matmul the layer then runs itself.
    """

    def __init__(
        self,
        to_wrap: torch.nn.Module,
        n_adapters: int,
        dim: int,
        alpha: float,
        full_name: str,
        column_init_method: str = "xavier",
        row_init_method: str = "zero",
        dropout: float = 0.0,
        dropout_position: str = "pre",
        a2a_experimental: bool = False,
        sequence_parallel: Optional[bool] = None,
        gated_output: bool = False,
        seed: int = 1234,
        fully_sharded: bool = False,
    ) -> None:
        super().__init__()
        where = f"{type(self).__name__}({full_name})"
        if n_adapters < 1 or dim < 1:
            raise ValueError(f"{where}: n_adapters={n_adapters} and dim={dim} must be >= 1")
        if column_init_method not in _INIT_METHODS or row_init_method not in _INIT_METHODS:
            raise ValueError(f"{where}: init methods must be one of {_INIT_METHODS}, got "
                             f"{column_init_method!r}/{row_init_method!r}")
        if dropout_position not in ("pre", "post") or not 0.0 <= dropout < 1.0:
            raise ValueError(f"{where}: dropout={dropout} must be in [0, 1) and "
                             f"dropout_position={dropout_position!r} 'pre' or 'post'")
        if a2a_experimental:
            raise ValueError(f"{where}: a2a_experimental=True is not supported")
        self._check_base(to_wrap, where)

        self.to_wrap = to_wrap
        self.n_adapters, self.dim, self.full_name = n_adapters, dim, full_name
        self.column_init_method, self.row_init_method = column_init_method, row_init_method
        self.dropout, self.dropout_position, self.seed = dropout, dropout_position, seed
        self.gated_output = gated_output
        self.sharding = self._sharding(to_wrap, sequence_parallel, fully_sharded)
        self._check_fully_sharded(to_wrap, where)
        self._returns_ln_output = type(to_wrap).__name__ == "TELayerNormColumnParallelLinear"
        if self._returns_ln_output:
            # LoRA reads the normalised input; TE hands it back next to the output.
            to_wrap.return_layernorm_output = True
            to_wrap.return_layernorm_output_gathered = False

        self.adapters = torch.nn.ModuleList(self._new_slot(alpha) for _ in range(n_adapters))
        # Not module state: each slot's Parameters stay its own (keys, optimizers, grads).
        self._factor_buffers = {f: SlotFactorBuffer(self._slot_params(f), f) for f in "AB"}
        device = self.adapters[0].alpha.device
        self.register_buffer("scale", torch.zeros(n_adapters, dtype=torch.float32, device=device),
                             persistent=False)
        self.register_buffer("dropout_p", torch.zeros(n_adapters, dtype=torch.float32,
                                                      device=device), persistent=False)
        self.slot_tokens: Optional[SlotTokens] = None
        for idx in range(n_adapters):
            self.reset_adapter(idx)
        self._refresh_scale()
        # The base keeps its own state-dict keys (no "to_wrap." level), so base checkpoints
        # load into wrapped and unwrapped models alike.
        self._register_state_dict_hook(_strip_wrap_prefix)
        self._register_load_state_dict_pre_hook(_add_wrap_prefix, with_module=True)
        self.register_load_state_dict_post_hook(_refresh_after_load)

    def _check_base(self, to_wrap: torch.nn.Module, where: str) -> None:
        if getattr(to_wrap, "gather_output", False):
            raise ValueError(f"{where}: bases with gather_output=True are not supported")
        if getattr(to_wrap, "is_expert", False):
            raise ValueError(f"{where}: expert linears are wrapped by MultiLoRAGroupedExpertLinear")
        if isinstance(to_wrap, RowParallelLinear) and not to_wrap.input_is_parallel:
            raise ValueError(f"{where}: row-parallel bases need input_is_parallel=True")

    def _new_slot(self, alpha: float) -> LoRASlot:
        """A slot shaped like this rank's shard of the base, its factors tagged for megatron."""
        weight, sh = self.to_wrap.weight, self.sharding
        out_local, in_local = weight.shape
        if sh.kind == "row" and sh.b_split_dim == 0:  # the base's output is not split, B is
            out_local //= sh.tp_size
        slot = LoRASlot(in_local, out_local, self.dim, alpha, self.dropout, weight.dtype,
                        weight.device, rank_shards=sh.tp_size if sh.rank_is_split else 1)
        a_partial, b_partial = self.sharding.partial_grad_factors()
        self._tag(slot.linear_in.weight, self.sharding.a_split_dim, a_partial)
        self._tag(slot.linear_out.weight, self.sharding.b_split_dim, b_partial)
        return slot

    def _sharding(self, to_wrap: torch.nn.Module, sequence_parallel: Optional[bool],
                  fully_sharded: bool) -> Sharding:
        sp = getattr(to_wrap, "sequence_parallel", None)
        sp = bool(sequence_parallel) if sp is None else sp
        group = getattr(to_wrap, "tp_group", None)
        if group is None and parallel_state.model_parallel_is_initialized():
            group = parallel_state.get_tensor_model_parallel_group()
        if group is None:
            return Sharding(base_kind(to_wrap), 1, 0, False, None)
        tp_size = torch.distributed.get_world_size(group)
        tp_rank = torch.distributed.get_rank(group)
        return Sharding(base_kind(to_wrap), tp_size, tp_rank, sp and tp_size > 1, group,
                        fully_sharded)

    def _check_fully_sharded(self, to_wrap: torch.nn.Module, where: str) -> None:
        sh = self.sharding
        if not sh.sharded_lora:
            return
        if not isinstance(to_wrap, (ColumnParallelLinear, RowParallelLinear)):
            raise ValueError(
                f"{where}: fully_sharded=True needs megatron's ColumnParallelLinear/"
                f"RowParallelLinear base, got {type(to_wrap).__name__} (TE linears run their "
                "collectives inside TE): build the model with the local (non-TE) spec or use "
                "fully_sharded=False")
        if sh.rank_is_split and self.dim % sh.tp_size:
            raise ValueError(f"{where}: fully_sharded=True splits the rank dim over "
                             f"{sh.tp_size} TP ranks; dim={self.dim} must be a multiple of it")
        if sh.kind == "row" and to_wrap.weight.size(0) % sh.tp_size:
            raise ValueError(f"{where}: fully_sharded=True splits B's {to_wrap.weight.size(0)} "
                             f"output rows over {sh.tp_size} TP ranks: they must divide evenly")

    @staticmethod
    def _tag(param: torch.nn.Parameter, split_dim: Optional[int], partial_grad: bool) -> None:
        set_tensor_model_parallel_attributes(param, split_dim is not None,
                                             0 if split_dim is None else split_dim, 1)
        param.sequence_parallel = partial_grad

    # ----- slot lifecycle -------------------------------------------------------------

    def _check_idx(self, idx: int) -> None:
        if not 0 <= idx < self.n_adapters:
            raise IndexError(f"{type(self).__name__}({self.full_name}): slot {idx} is out of range "
                             f"0..{self.n_adapters - 1}")

    def _refresh_scale(self) -> None:
        """Per-slot alpha/rank and dropout, read by forward from two small buffers."""
        with torch.no_grad():
            for i, slot in enumerate(self.adapters):
                self.scale[i] = slot.alpha / slot.rank
                self.dropout_p[i] = slot.dropout
        # Read once here, so forward needs no device-to-host sync to skip dropout or to pick
        # the rank it computes at.
        self._ranks = [int(slot.rank) for slot in self.adapters]
        self._rates = [float(slot.dropout) for slot in self.adapters]
        self._alphas = [float(slot.alpha) for slot in self.adapters]

    def full_shape(self, factor: str) -> tuple[int, ...]:
        """The unsharded shape of factor ``"A"`` or ``"B"`` (slot 0's; all slots agree)."""
        slot = self.adapters[0]
        weight = slot.linear_in.weight if factor == "A" else slot.linear_out.weight
        split = self.sharding.a_split_dim if factor == "A" else self.sharding.b_split_dim
        shape = list(weight.shape)
        if split is not None:
            shape[split] *= self.sharding.tp_size
        return tuple(shape)

    def local_shard(self, factor: str, full: torch.Tensor) -> torch.Tensor:
        """This TP rank's shard of an unsharded factor ``"A"`` or ``"B"``."""
        split = self.sharding.a_split_dim if factor == "A" else self.sharding.b_split_dim
        if split is None:
            return full
        tp, rank = self.sharding.tp_size, self.sharding.tp_rank
        if factor == "B" and self.gated_output:
            return shard_gate_up(full, rank, tp)  # a gated fc1's rows: [gate_r; up_r]
        return full.chunk(tp, dim=split)[rank]

    def gather_full(self, factor: str, local: torch.Tensor) -> torch.Tensor:
        """The unsharded factor ``"A"`` or ``"B"`` from this rank's shard ``local`` (the
        inverse of :meth:`local_shard`). Collective over the TP group when the factor is split."""
        split = self.sharding.a_split_dim if factor == "A" else self.sharding.b_split_dim
        if split is None:
            return local
        parts = all_gather_list(local, self.sharding.group)
        if factor == "B" and self.gated_output:
            return unshard_gate_up(parts)  # each rank holds [gate_r; up_r]
        return torch.cat(parts, dim=split)

    def _generator(self, *key: object) -> torch.Generator:
        """A CPU generator seeded by (seed, layer name, key): the same on every rank."""
        text = ":".join(str(k) for k in (self.seed, self.full_name, *key))
        return torch.Generator().manual_seed(zlib.crc32(text.encode()))

    def reset_adapter(self, idx: int, init_key: Optional[str] = None) -> None:
        """Re-initialise slot ``idx``'s weights, identically on every rank and TP layout.

        Each factor is drawn as the full (unsharded) tensor from a generator seeded by
        (seed, layer name, ``init_key`` or the slot index), then this rank's shard is kept:
        data-parallel replicas agree and the adapter does not depend on the TP size (nor, with
        an ``init_key``, on the slot).
        """
        self._check_idx(idx)
        slot = self.adapters[idx]
        gen = self._generator(idx if init_key is None else init_key)
        with torch.no_grad():
            for linear, method, factor in ((slot.linear_in, self.column_init_method, "A"),
                                           (slot.linear_out, self.row_init_method, "B")):
                full = _init_weight(method, self.full_shape(factor), gen)
                linear.weight.copy_(self.local_shard(factor, full))
        self._apply_rank_mask(idx)

    def _apply_rank_mask(self, idx: int) -> None:
        """Zero A's rank rows and B's rank columns beyond the slot's rank.

        A is ``[..., dim, in]`` and B ``[..., out, dim]`` (with a leading local-expert dim for
        expert layers); B's rank dim is never split over TP, A's is when fully sharded.
        """
        slot = self.adapters[idx]
        r = int(slot.rank)
        local = slot.linear_in.weight.size(-2)
        first = self.sharding.tp_rank * local if self.sharding.rank_is_split else 0
        with torch.no_grad():
            slot.linear_in.weight[..., max(0, min(local, r - first)):, :].zero_()
            slot.linear_out.weight[..., r:].zero_()

    def init_adapter_slot(self, idx: int, rank: int, alpha: float,
                          dropout: Optional[float] = None) -> None:
        """Claim slot ``idx``: bind rank, alpha (and dropout) and zero the padded rank."""
        self._check_idx(idx)
        where = f"{type(self).__name__}({self.full_name})"
        if not isinstance(rank, int) or not 1 <= rank <= self.dim:
            raise ValueError(f"{where}: rank={rank} is outside 1..{self.dim} (the layer's max "
                             "rank dim)")
        if dropout is not None and not 0.0 <= dropout < 1.0:
            raise ValueError(f"{where}: dropout={dropout} must be in [0, 1)")
        slot = self.adapters[idx]
        slot.rank.fill_(rank)
        slot.alpha.fill_(float(alpha))
        if dropout is not None:
            slot.dropout.fill_(float(dropout))
        self._apply_rank_mask(idx)
        self._refresh_scale()

    def clear_adapter_slot(self, idx: int, init_key: Optional[str] = None) -> None:
        """Free slot ``idx``: zero alpha, restore max rank, re-initialise its weights."""
        self._check_idx(idx)
        slot = self.adapters[idx]
        slot.rank.fill_(self.dim)
        slot.alpha.zero_()
        slot.dropout.fill_(self.dropout)
        self.reset_adapter(idx, init_key)
        self._refresh_scale()

    # ----- forward ----------------------------------------------------------------------

    def _segments(self, rows: int, is_shard: bool, device: torch.device) -> Segments:
        """This input's/output's per-slot row groups within the packed micro-batch."""
        tokens = self.slot_tokens
        expected = tokens.total // self.sharding.tp_size if is_shard else tokens.total
        if rows != expected or (is_shard and tokens.total % self.sharding.tp_size):
            what = (f"this rank's sequence shard of {tokens.total} tokens over "
                    f"{self.sharding.tp_size} ranks" if is_shard else f"{tokens.total} tokens")
            raise ValueError(
                f"MultiLoRALinear({self.full_name}): input has {rows} tokens but "
                f"tokens_per_adapter={list(tokens.counts)} describes {what}; the counts must "
                "sum to the micro-batch's tokens (sequence x batch)")
        return tokens.segments(self.sharding.tp_rank * rows if is_shard else 0, rows, device)

    def _active_slots(self) -> tuple[int, ...]:
        """The slots with tokens in this micro-batch (the same on every TP rank)."""
        if self.slot_tokens is None:
            raise RuntimeError(f"{type(self).__name__}({self.full_name}): no token counts; pass "
                               "packed_seq_params carrying them (MicroBatch.packed_seq_params, "
                               "with_slot_layout) or call set_tokens_per_adapter_slot(model, "
                               "counts) before forward")
        return self.slot_tokens.active

    def _compute_rank(self, slots: tuple[int, ...]) -> int:
        """The rank the GEMMs run at: the largest rank among ``slots`` that have alpha != 0
        (padded rank rows are zero, so computing fewer changes nothing), rounded up to a
        multiple of 8 so the ``[tokens, r]`` buffer keeps the grouped kernel's alignment."""
        if self.sharding.rank_is_split:
            return self.dim
        r = max((self._ranks[i] for i in slots if self._alphas[i] != 0.0), default=1)
        return min(self.dim, -(-r // 8) * 8)

    def _slot_params(self, factor: str, slots: Optional[tuple[int, ...]] = None
                     ) -> list[torch.nn.Parameter]:
        """Factor ``"A"`` or ``"B"``'s Parameters of ``slots`` (default: every slot)."""
        slots = range(self.n_adapters) if slots is None else slots
        name = "linear_in" if factor == "A" else "linear_out"
        return [getattr(self.adapters[i], name).weight for i in slots]

    def _slot_factors(self, factor: str, slots: tuple[int, ...], r: int
                      ) -> tuple[torch.Tensor, Optional[Callable[[], torch.Tensor]]]:
        """A ``[G, ..., r, in]`` or B ``[G, ..., out, r]`` of ``slots``, cut to rank ``r``,
        read from the layer's contiguous slot buffer (see :mod:`.slot_factors`), and how to
        rebuild it in backward when it is a copy."""
        return self._factor_buffers[factor].gather(slots, self._slot_params(factor, slots), r)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        if "adapters" in self._modules:  # a conversion gave the Parameters new data
            for factor, buffer in self._factor_buffers.items():
                buffer.realias(self._slot_params(factor))
        return self

    def _slot_dropout(self, t: torch.Tensor, seg: Segments, slots: tuple[int, ...],
                      tp_sharded: bool) -> torch.Tensor:
        """Inverted dropout of ``t``'s rows, grouped by slot with host-known counts, each at
        its slot's rate: only the slots with a rate above zero draw random numbers and pay
        the masking passes. Rows whose values differ across TP ranks draw from megatron's
        tensor-parallel RNG stream; replicated rows from the default stream, which TP ranks
        share."""
        rates = [self._rates[s] for s in slots]
        if not self.training or not any(rates):
            return t
        with tensor_parallel.get_cuda_rng_tracker().fork() if tp_sharded else contextlib.nullcontext():
            pieces = [piece if rate == 0 else F.dropout(piece, rate)
                      for rate, piece in zip(rates, t.split(seg.counts))]
        return torch.cat(pieces)

    def _lora(self, x2: torch.Tensor, slots: tuple[int, ...], in_shard: bool,
              out_shard: bool) -> torch.Tensor:
        """``s * B @ (A @ x)`` for the rows of ``x2`` (``[rows, in]``) over ``slots``, with
        the layout's collective on the small ``[rows, r]`` buffer in between."""
        sh = self.sharding
        seg_in = self._segments(x2.size(0), in_shard, x2.device)
        if self.dropout_position == "pre":
            x2 = self._slot_dropout(x2, seg_in, slots, sh.input_is_tp_sharded)
        r = self._compute_rank(slots)
        # A copied factor stack is rebuilt for backward rather than kept: nothing but the
        # slots' own parameters grows with the number of slots.
        a, rebuild_a = self._slot_factors("A", slots, r)
        mid = grouped_linear(x2.contiguous(), a, seg_in, rebuild_w=rebuild_a)
        mid = sh.reduce_mid(mid)                                           # [T, r]
        seg_out = self._segments(mid.size(0), out_shard, mid.device)
        # Per-token alpha/rank on the small [T, r] buffer, in fp32 (as serving kernels do).
        mid = (mid.float() * self.scale[seg_out.label_of_row].unsqueeze(1)).to(mid.dtype)
        b, rebuild_b = self._slot_factors("B", slots, r)
        lora = grouped_linear(mid, b, seg_out, rebuild_w=rebuild_b)  # [T, out]
        if self.dropout_position == "post":
            lora = self._slot_dropout(lora, seg_out, slots, sh.output_is_tp_sharded)
        return lora

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        slots = self._active_slots()
        if self.sharding.sharded_lora:
            return self._forward_fully_sharded(x, slots, *args, **kwargs)
        result = self.to_wrap(x, *args, **kwargs)
        # Megatron/TE linears return (output, bias); plain torch linears a tensor.
        base_out, bias = result if isinstance(result, tuple) else (result, None)
        if self._returns_ln_output:
            base_out, x = base_out
        if not slots:
            return (base_out, bias) if isinstance(result, tuple) else base_out
        sh = self.sharding
        lora = self._lora(x.reshape(-1, x.size(-1)), slots, sh.input_is_sequence_shard,
                          sh.output_is_sequence_shard)
        out = add_lora(base_out, lora.view_as(base_out))
        return (out, bias) if isinstance(result, tuple) else out

    def _forward_fully_sharded(self, x: torch.Tensor, slots: tuple[int, ...], *args: Any,
                               **kwargs: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The base's matmul with its collective run here, so that collective also completes
        the LoRA term (see :mod:`.sharding`); the base's bias conventions are kept."""
        if args or kwargs:
            raise TypeError(f"MultiLoRALinear({self.full_name}): a fully sharded layer takes only "
                            f"its input, got extra arguments {args} {sorted(kwargs)}")
        base, sh = self.to_wrap, self.sharding
        add_bias = None if base.skip_bias_add else base.bias
        out_bias = base.bias if base.skip_bias_add else None
        if sh.kind == "column":
            x_full = sh.base_input(x)  # bwd: one reduction sums the base's and LoRA's dgrad
            out = F.linear(x_full, base.weight, add_bias)
            if slots:
                out = add_lora(out, self._lora(x_full.reshape(-1, x_full.size(-1)), slots,
                                               False, False).view_as(out))
            return out, out_bias
        x2 = x.reshape(-1, x.size(-1))
        partial = F.linear(x2, base.weight)  # [T, out]: this rank's partial sum
        if slots:
            lora = self._lora(x2, slots, False, False)  # [T, out/tp]: this rank's columns
            width = lora.size(1)
            partial[:, sh.tp_rank * width:(sh.tp_rank + 1) * width] += lora
        out = sh.base_output(partial.view(*x.shape[:-1], partial.size(-1)))
        return (out if add_bias is None else out + add_bias), out_bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """megatron dist-checkpointing view: the base's own keys and sharding, plus the
        adapter tensors (``adapters.i.*``, or ``adapter.*`` while a slot is exposed) with
        their TP split axes, so checkpoints reshard across TP layouts."""
        sharded = sharded_state_dict_default(self.to_wrap, prefix, sharded_offsets, metadata)
        split = {"A": self.sharding.a_split_dim, "B": self.sharding.b_split_dim}
        factor_of = {}  # parameter -> "A" | "B", by identity
        for slot in self.modules():
            if isinstance(slot, LoRASlot):
                factor_of[slot.linear_in.weight] = "A"
                factor_of[slot.linear_out.weight] = "B"
        tensors, axes, gated_keys = {}, {}, []
        for name, child in self.named_children():
            if child is self.to_wrap:
                continue
            for key, value in child.state_dict(prefix=f"{name}.", keep_vars=True).items():
                tensors[key] = value
                factor = factor_of.get(value)
                if factor is not None and split[factor] is not None:
                    axes[key] = split[factor]
                    if factor == "B" and self.gated_output:
                        gated_keys.append(prefix + key)
        adapters = make_sharded_tensors_for_checkpoint(tensors, prefix, axes, sharded_offsets)
        singleton = (metadata or {}).get("singleton_local_shards", False)
        for key in gated_keys:  # B rows are [gate; up] per rank, as the base's fc1 weight
            adapters[key] = apply_swiglu_sharded_factory(adapters[key], sharded_offsets, singleton)
        sharded.update(adapters)
        return sharded

    def extra_repr(self) -> str:
        return (f"n_adapters={self.n_adapters}, dim={self.dim}, base={self.sharding.kind}, "
                f"tp={self.sharding.tp_size}, sequence_parallel={self.sharding.sequence_parallel}")


def _refresh_after_load(module: MultiLoRALinear, incompatible_keys: Any) -> None:
    if "adapters" in module._modules:  # not while hide_adapters/expose_adapter_slot is active
        module._refresh_scale()


def _strip_wrap_prefix(module, state_dict, prefix, local_metadata):
    inner = prefix + "to_wrap."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)
    return state_dict


def _add_wrap_prefix(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    for name in module.to_wrap.state_dict().keys():
        if prefix + name in state_dict:
            state_dict[prefix + "to_wrap." + name] = state_dict.pop(prefix + name)

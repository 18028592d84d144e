"""``MultiLoRALinear``: a Megatron parallel linear with N concurrent LoRA adapter slots.

For a token t of slot s (LoRA, Hu et al. 2021, with per-slot rank and alpha)::

    y_t = base(x_t) + (alpha_s / r_s) * B_s[:, :r_s] @ A_s[:r_s] @ x_t

Every slot is allocated at the max rank ``max_rank``; rows ``[r_s:]`` of A_s and columns
``[:, r_s:]`` of B_s are kept at zero, so padded rank never contributes and its gradients
stay zero. A packed micro-batch holds each slot's tokens contiguously (adapter-major); its
slot layout (:class:`~megatron_multilora.ops.slot_layout.SlotLayout`, handed over by
:mod:`.slot_layout_route`) says how many. :func:`lora_term` is the math: two grouped GEMMs
over those slot segments with one TP collective on the small ``[tokens, r]`` buffer between
them (where each factor lives, and that collective, per base kind: :mod:`.sharding`). The
per-slot scale is applied in fp32 to that small buffer, as serving kernels apply it, rather
than to the full ``[tokens, out]`` output. Only the slots with tokens in the micro-batch take
part, at the largest rank among them: an idle slot costs no GEMM work and gets no gradient,
and a padded rank is not computed; a micro-batch of one slot (a job training alone) runs
the same math on the slot's own Parameters, unstacked (:func:`one_slot_term`). The slots themselves (factors,
rank/alpha/dropout, claim/clear) are the layer's :class:`~.slot_bank.SlotBank`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.utils import sharded_state_dict_default

from megatron_multilora.deprecation import renamed_arguments, renamed_property
from megatron_multilora.layers.factors import FACTORS, A, B, Factor
from megatron_multilora.layers.grouped_gemm import grouped_linear
from megatron_multilora.layers.sharding import dense_layout
from megatron_multilora.layers.slot_bank import LoRASlot, SlotBank
from megatron_multilora.layers.slot_dropout import dropout_by_counts
from megatron_multilora.layers.tp_layout import TPLayout
from megatron_multilora.ops.grouped_mm import single_group_mm
from megatron_multilora.ops.slot_layout import Segments, SlotLayout
from megatron_multilora.validation import INIT_METHODS

Stack = tuple[torch.Tensor, Callable[[], torch.Tensor] | None]  # (factor stack, its rebuild)

__all__ = ["LoRASlot", "MultiLoRALinear", "lora_term"]


def lora_term(
    x: torch.Tensor,
    a: Stack,
    b: Stack,
    seg_in: Segments,
    seg_out: Callable[[int], Segments],
    scale: torch.Tensor,
    reduce_mid: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``(alpha_s / r_s) * B_s @ A_s @ x_t`` for every row t, grouped by slot.

    ``x`` ``[T, in]``; ``a`` / ``b`` the active slots' stacked factors (``[G, r, in]``,
    ``[G, out, r]``) with their backward rebuilds; ``seg_in`` the row groups of ``x``,
    ``seg_out(rows)`` those of ``mid`` after the layout's collective ``reduce_mid``;
    ``scale`` alpha/rank per slot. Returns ``[T', out]``.
    """
    mid = grouped_linear(x, a[0], seg_in, rebuild_w=a[1])  # [T, r] = A x
    mid = reduce_mid(mid)  # the layout's one collective
    seg = seg_out(mid.size(0))
    scaled = _fp32(mid) * scale[seg.label_of_row].unsqueeze(1)  # fp32, per token
    return grouped_linear(_as(scaled, mid.dtype), b[0], seg, rebuild_w=b[1])  # B (s A x)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return _as(t, torch.float32)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A conversion to the same dtype is no copy, but still an op per call.
    return t if t.dtype == dtype else t.to(dtype)


def one_slot_term(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    reduce_mid: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """:func:`lora_term` when one slot holds every row: ``a`` ``[r, in]`` and ``b``
    ``[out, r]`` are that slot's own Parameters (cut to the rank), ``scale`` its alpha/rank.
    Their gradients go straight into the Parameters: stacking and grouping cost more than
    the rank-r GEMMs themselves at a micro-batch's rows (a job that trains alone; figures:
    benchmarks/README.md). Each product runs the GEMMs of its group
    in the grouped call (``single_group_mm``), so a slot's rows get the same bits alone as
    beside other slots."""
    mid = reduce_mid(single_group_mm(x, _as(a, x.dtype)))  # [T, r] = A x
    mid = _as(_fp32(mid) * scale, mid.dtype)
    return single_group_mm(mid, _as(b, mid.dtype))  # [T, out] = B (s A x)


def check_settings(
    where: str,
    n_slots: int,
    max_rank: int,
    column_init_method: str,
    row_init_method: str,
    dropout: float,
    dropout_position: str,
) -> None:
    """What every multi-LoRA layer refuses at construction, on every rank alike."""
    if n_slots < 1 or max_rank < 1:
        raise ValueError(f"{where}: n_slots={n_slots} and max_rank={max_rank} must be >= 1")
    if column_init_method not in INIT_METHODS or row_init_method not in INIT_METHODS:
        raise ValueError(
            f"{where}: init methods must be one of {INIT_METHODS}, got "
            f"{column_init_method!r}/{row_init_method!r}"
        )
    if dropout_position not in ("pre", "post") or not 0.0 <= dropout < 1.0:
        raise ValueError(
            f"{where}: dropout={dropout} must be in [0, 1) and "
            f"dropout_position={dropout_position!r} 'pre' or 'post'"
        )


class MultiLoRALinear(torch.nn.Module):
    """Megatron parallel linear wrapped with ``n_slots`` concurrent LoRA slots.

    Args:
        to_wrap: the frozen base linear; ``forward`` returns what it returns, plus LoRA.
        n_slots: number of slots N (formerly ``n_adapters``, still accepted, deprecated).
        max_rank: every slot is allocated at this rank (formerly ``dim``, deprecated).
        alpha: initial alpha of every slot (per-slot values via ``init_adapter_slot``).
        full_name: the module's path in the model, used in errors and to seed init.
        column_init_method / row_init_method: init of A / B ("xavier", "kaiming",
            "normal", "zero"); B at zero makes a fresh adapter a no-op.
        dropout / dropout_position: dropout on the LoRA input ("pre") or output ("post");
            ``dropout`` is every slot's initial rate (per-slot via ``init_adapter_slot``).
        a2a_experimental: accepted for API compatibility; only False is supported.
        sequence_parallel: the model's flag, for TP-replicated bases (plain linears, TE's
            duplicated ones) and bases that do not carry it; TP-split megatron and TE
            bases use their own.
        gated_output: the base is a gated MLP's fc1, whose output is ``[gate; up]`` within
            each TP rank's shard; B's rows follow that layout in checkpoints.
        seed: base seed of the deterministic, layout-independent slot initialisation.
        fully_sharded: under TP, shard every factor (S-LoRA; layouts in :mod:`.sharding`):
            A on its rank dim (column-parallel bases) or B on its output dim (row-parallel
            bases); needs megatron's own ColumnParallelLinear/RowParallelLinear bases, whose
            matmul the layout then runs itself.
    """

    @renamed_arguments(n_adapters="n_slots", dim="max_rank")
    def __init__(
        self,
        to_wrap: torch.nn.Module,
        n_slots: int,
        max_rank: int,
        alpha: float,
        full_name: str,
        column_init_method: str = "xavier",
        row_init_method: str = "zero",
        dropout: float = 0.0,
        dropout_position: str = "pre",
        a2a_experimental: bool = False,
        sequence_parallel: bool | None = None,
        gated_output: bool = False,
        seed: int = 1234,
        fully_sharded: bool = False,
    ) -> None:
        where = f"{type(self).__name__}({full_name})"
        check_settings(
            where, n_slots, max_rank, column_init_method, row_init_method, dropout, dropout_position
        )
        if a2a_experimental:
            raise ValueError(f"{where}: a2a_experimental=True is not supported")
        layout = self._layout(
            to_wrap, sequence_parallel, fully_sharded, gated_output, max_rank, where
        )
        super().__init__()
        self.to_wrap, self.tp_layout, self.full_name, self.where = to_wrap, layout, full_name, where
        self._init_methods = {A: column_init_method, B: row_init_method}
        self._dropout_position, self.seed = dropout_position, seed
        self.slot_layout: SlotLayout | None = None
        self.register_buffer("row_mask", None, persistent=False)
        dtype, device = _weight_dtype_device(to_wrap)
        self.adapters = SlotBank(
            n_slots,
            max_rank,
            shapes=layout.slot_shapes(to_wrap, max_rank),
            alpha=alpha,
            dropout=dropout,
            dtype=dtype,
            device=device,
            tag=layout.tag,
            rank_offset=layout.rank_offset,
            where=self.where,
        )
        for idx in range(n_slots):
            self.reset_adapter(idx)
        # The base keeps its own state-dict keys (no "to_wrap." level), so base checkpoints
        # load into wrapped and unwrapped models alike.
        self._register_state_dict_hook(_strip_wrap_prefix)
        self._register_load_state_dict_pre_hook(_add_wrap_prefix, with_module=True)
        self.register_load_state_dict_post_hook(_refresh_after_load)
        self.returns_ln_output = type(to_wrap).__name__ == "TELayerNormColumnParallelLinear"
        if self.returns_ln_output:
            # LoRA reads the normalised input; TE hands it back next to the output.
            to_wrap.return_layernorm_output = True
            to_wrap.return_layernorm_output_gathered = False

    def _layout(
        self,
        to_wrap: torch.nn.Module,
        sequence_parallel: bool | None,
        fully_sharded: bool,
        gated_output: bool,
        max_rank: int,
        where: str,
    ) -> TPLayout:
        """Where the slots' factors live for this base (checked): the layer kinds' one
        difference at construction (the expert layer's is by whole experts)."""
        _check_dense_base(to_wrap, where)
        return dense_layout(
            to_wrap, sequence_parallel, fully_sharded, gated_output, max_rank, where
        )

    # ----- the slots (the work is the SlotBank's) -------------------------

    @property
    def n_slots(self) -> int:
        return len(self.adapters)

    @property
    def max_rank(self) -> int:
        return self.adapters.max_rank

    n_adapters = renamed_property("n_adapters", "n_slots")
    dim = renamed_property("dim", "max_rank")

    # The constructor's settings, read-only (each slot's own rank, alpha and dropout are the
    # SlotBank's).
    @property
    def column_init_method(self) -> str:
        return self._init_methods[A]

    @property
    def row_init_method(self) -> str:
        return self._init_methods[B]

    @property
    def dropout(self) -> float:
        """Every slot's initial LoRA dropout rate (a freed slot returns to it)."""
        return self.adapters.default_dropout

    @property
    def dropout_position(self) -> str:
        return self._dropout_position

    def reset_adapter(self, idx: int, init_key: str | None = None) -> None:
        """Re-initialise slot ``idx``'s weights, identically on every rank and layout: drawn
        from a generator seeded by (seed, layer name, ``init_key`` or the slot index), so
        data-parallel replicas agree and the adapter does not depend on the layout (nor,
        with an ``init_key``, on the slot)."""
        self.adapters.check(idx)
        shapes = {f: tuple(f.weight(self.adapters[idx]).shape) for f in FACTORS}
        self.adapters.load(
            idx,
            self.tp_layout.draw(
                self._init_methods, shapes, self._generator, idx if init_key is None else init_key
            ),
        )

    def init_adapter_slot(
        self, idx: int, rank: int, alpha: float, dropout: float | None = None
    ) -> None:
        """Claim slot ``idx``: bind rank, alpha (and dropout) and zero the padded rank."""
        self.adapters.claim(idx, rank, alpha, dropout)

    def clear_adapter_slot(self, idx: int, init_key: str | None = None) -> None:
        """Free slot ``idx``: zero alpha, restore max rank, re-initialise its weights."""
        self.adapters.release(idx)
        self.reset_adapter(idx, init_key)

    def adapt_only_rows(self, kept: torch.Tensor, parts: frozenset[str]) -> None:
        """Adapt only the output rows ``kept`` (bool, this rank's rows: those of the fused
        ``parts``) in every slot: B is zero elsewhere and the LoRA term masked there, so
        those rows get no gradient (:mod:`.fused_parts`)."""
        self.adapted_parts = parts
        b = B.weight(self.adapters[0])
        self.row_mask = kept.to(device=b.device, dtype=b.dtype)
        self.adapters.kept_rows = kept.to(b.device)
        for idx in range(self.n_slots):
            self.adapters.mask_rank(idx)

    def masked(self, lora: torch.Tensor) -> torch.Tensor:
        """The LoRA term with the rows outside :meth:`adapt_only_rows` zeroed."""
        return lora if self.row_mask is None else lora * _as(self.row_mask, lora.dtype)

    def full_shape(self, factor: Factor) -> tuple[int, ...]:
        """The unsharded shape of ``factor`` (slot 0's; all slots agree)."""
        return self.tp_layout.full_shape(factor, tuple(factor.weight(self.adapters[0]).shape))

    def _generator(self, *key: object) -> torch.Generator:
        """A CPU generator seeded by (seed, layer name, key): the same on every rank."""
        text = ":".join(str(k) for k in (self.seed, self.full_name, *key))
        return torch.Generator().manual_seed(zlib.crc32(text.encode()))

    # ----- forward ----------------------------------------------------------------------

    def _active_slots(self) -> tuple[int, ...]:
        """The slots with tokens in this micro-batch (the same on every TP rank)."""
        if self.slot_layout is None:
            raise RuntimeError(
                f"{self.where}: no slot layout; pass packed_seq_params carrying "
                "it (with_slot_layout) or call set_tokens_per_adapter_slot(model, "
                "counts) before forward"
            )
        return self.slot_layout.active

    def _segments(self, rows: int, is_shard: bool, device: torch.device) -> Segments:
        """This input's/output's per-slot row groups within the packed micro-batch."""
        slots, tp = self.slot_layout, self.tp_layout.tp_size
        expected = slots.total // tp if is_shard else slots.total
        if rows != expected or (is_shard and slots.total % tp):
            what = (
                f"this rank's sequence shard of {slots.total} tokens over {tp} ranks"
                if is_shard
                else f"{slots.total} tokens"
            )
            raise ValueError(
                f"{self.where}: input has {rows} tokens but tokens_per_adapter="
                f"{list(slots.counts)} describes {what}; the counts must sum to the "
                "micro-batch's tokens (sequence x batch)"
            )
        return slots.segments(self.tp_layout.tp_rank * rows if is_shard else 0, rows, device)

    def lora(
        self, x2: torch.Tensor, slots: tuple[int, ...], in_shard: bool, out_shard: bool
    ) -> torch.Tensor:
        """The LoRA term of ``slots`` for the rows of ``x2`` (``[rows, in]``)."""
        bank, tp_layout = self.adapters, self.tp_layout
        seg_in = self._segments(x2.size(0), in_shard, x2.device)
        rates = [bank.rates[s] for s in slots]
        if self.dropout_position == "pre":
            x2 = dropout_by_counts(
                x2, seg_in.counts, rates, self.training, tp_layout.varies("input")
            )
        r = bank.compute_rank(slots, tp_layout.rank_is_split)
        if len(slots) == 1:  # every row is this slot's (the counts sum to the rows)
            slot = bank[slots[0]]
            lora = one_slot_term(
                x2,
                A.cut(A.weight(slot), r),
                B.cut(B.weight(slot), r),
                bank.scale[slots[0]],
                tp_layout.reduce_mid,
            )
        else:
            # A copied factor stack is rebuilt for backward rather than kept: nothing but the
            # slots' own parameters grows with the number of slots.
            lora = lora_term(
                x2.contiguous(),
                bank.stack(A, slots, r),
                bank.stack(B, slots, r),
                seg_in,
                lambda rows: self._segments(rows, out_shard, x2.device),
                bank.scale,
                tp_layout.reduce_mid,
            )
        if self.dropout_position == "post":
            lora = dropout_by_counts(
                lora,
                self._segments(lora.size(0), out_shard, lora.device).counts,
                rates,
                self.training,
                tp_layout.varies("output"),
            )
        return self.masked(lora)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """The base's output plus the LoRA term of the micro-batch's slots: the layout calls
        the base and says where the term reads and meets it; the layer computes it."""
        slots = self._active_slots()
        call = self.tp_layout.call_base(
            self.to_wrap, x, args, kwargs, self.returns_ln_output, self.where
        )
        term = self.lora(call.rows, slots, call.in_shard, call.out_shard) if slots else None
        return call.output(term)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """megatron dist-checkpointing view: the base's own keys and sharding, plus the
        adapter tensors (``adapters.i.*``, or ``adapter.*`` while a slot is exposed) as the
        layout shards them, so checkpoints reshard across layouts."""
        sharded = sharded_state_dict_default(self.to_wrap, prefix, sharded_offsets, metadata)
        factor_of = {
            f.weight(slot): f
            for slot in self.modules()
            if isinstance(slot, LoRASlot)
            for f in FACTORS
        }
        tensors = {
            key: value
            for name, child in self.named_children()
            if child is not self.to_wrap
            for key, value in child.state_dict(prefix=f"{name}.", keep_vars=True).items()
        }
        sharded.update(
            self.tp_layout.sharded_state_dict(factor_of, tensors, prefix, sharded_offsets, metadata)
        )
        return sharded

    def extra_repr(self) -> str:
        return f"n_slots={self.n_slots}, max_rank={self.max_rank}, tp_layout={self.tp_layout}"


def _check_dense_base(to_wrap: torch.nn.Module, where: str) -> None:
    if getattr(to_wrap, "gather_output", False):
        raise ValueError(f"{where}: bases with gather_output=True are not supported")
    if getattr(to_wrap, "is_expert", False):
        raise ValueError(f"{where}: expert linears are wrapped by MultiLoRAGroupedExpertLinear")
    if isinstance(to_wrap, RowParallelLinear) and not to_wrap.input_is_parallel:
        raise ValueError(f"{where}: row-parallel bases need input_is_parallel=True")


def _refresh_after_load(module: MultiLoRALinear, incompatible_keys: Any) -> None:
    if "adapters" in module._modules:  # not while hide_adapters/expose_adapter_slot is active
        module.adapters.refresh()


def _strip_wrap_prefix(module, state_dict, prefix, local_metadata):
    inner = prefix + "to_wrap."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)
    return state_dict


def _add_wrap_prefix(
    module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
):
    for name in module.to_wrap.state_dict().keys():
        if prefix + name in state_dict:
            state_dict[prefix + "to_wrap." + name] = state_dict.pop(prefix + name)


def _weight_dtype_device(to_wrap: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    """The base weight's dtype and device; an output layer tied to the embedding holds no
    weight of its own (it is handed one at each call): its config's dtype, this rank's
    device."""
    weight = getattr(to_wrap, "weight", None)
    if weight is not None:
        return weight.dtype, weight.device
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    return to_wrap.config.params_dtype, device

"""Every slot's adapter parameters, their gradients and their optimizer state as rows of a
few ``[N, width]`` matrices, so per-slot work (gradient norms, clipping, AdamW) is a handful
of tensor ops over all slots instead of a loop over slots and parameters.

Each slot holds the same parameters (one per layer and factor), so one column layout serves
every slot: a dense matrix (TP-split and replicated factors; sequence-parallel partial
gradients first, which the TP sync reduces) and an expert matrix (reduced over the
expert-data-parallel group). Each parameter's columns start at a multiple of 16 elements, so
a row segment keeps the grouped GEMM's alignment.

The layers keep each factor of every slot in one ``[N, ...]`` buffer that the slots'
Parameters are views of (``layers/slot_factors.py``); :meth:`SlotRows.hold_parameters` points
those buffers at this layout's parameter matrices, whose rows the optimizer then updates in
place. The gradients live in matrices of the same layout: each parameter's ``main_grad``
(fp32) is its segment, which backward adds its gradient into.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from megatron_multilora.layers.factors import FACTORS
from megatron_multilora.layers.lifecycle import (
    ModelOrChunks,
    multi_lora_modules,
    num_adapter_slots,
    slot_parameters,
)

ALIGN = 16  # elements: 64 bytes in fp32, 32 in bf16


def is_dense(p: torch.nn.Parameter) -> bool:
    return getattr(p, "allreduce", True)


def is_tp_split(p: torch.nn.Parameter) -> bool:
    return getattr(p, "tensor_model_parallel", False)


def is_partial(p: torch.nn.Parameter) -> bool:
    # A partial sum over this TP rank's sequence shard (see layers/sharding.py); expert
    # factors never are (experts are not tensor-split).
    return getattr(p, "sequence_parallel", False)


@dataclasses.dataclass(frozen=True)
class Kind:
    """One matrix of the layout: its row width and, per parameter position within a slot,
    its first column (``None``: not in this matrix)."""

    width: int
    columns: tuple[int | None, ...]
    partial_end: int  # columns [0, partial_end) hold sequence-parallel partial gradients


class SlotRows:
    """The column layout of ``model``'s adapter parameters (every slot alike), the fp32
    gradient matrices (``grads``: ``"dense"``, ``"expert"``) and, after
    :meth:`hold_parameters`, the parameter matrices the layers' factor buffers view."""

    def __init__(self, model: ModelOrChunks) -> None:
        self.model = model
        self.n = num_adapter_slots(model)
        self.params = [slot_parameters(model, s) for s in range(self.n)]
        first = self.params[0]
        # Partial gradients first (the TP sync sums that range), then TP-split before
        # replicated factors: each kind's share of the gradient norm is then one column range.
        dense = sorted(
            (i for i, p in enumerate(first) if is_dense(p)),
            key=lambda i: (not is_partial(first[i]), not is_tp_split(first[i])),
        )
        expert = [i for i, p in enumerate(first) if not is_dense(p)]
        self.kinds = {"dense": _kind(first, dense), "expert": _kind(first, expert)}
        device = first[0].device
        # One buffer, [dense: N rows | expert: N rows]: adjacent rows are adjacent ranges, so
        # neighbouring slots' gradients reduce as one span (``grad_sync``).
        wd, we = self.kinds["dense"].width, self.kinds["expert"].width
        self.grad_buffer = torch.zeros(self.n * (wd + we), dtype=torch.float32, device=device)
        self.grads = {
            "dense": self.grad_buffer[: self.n * wd].view(self.n, wd),
            "expert": self.grad_buffer[self.n * wd :].view(self.n, we),
        }
        self.values: dict[str, torch.Tensor] = {}
        self._positions = {
            id(p): (s, i) for s, params in enumerate(self.params) for i, p in enumerate(params)
        }
        for s, params in enumerate(self.params):
            for i, p in enumerate(params):
                p.main_grad = self.segment(self.grads, s, i)
                p.register_post_accumulate_grad_hook(_accumulate)
        # A factor read for several slots at once adds their gradients to these rows in one op.
        for buffer, _, rows in self._factor_buffers(self.grads):
            buffer.main_grad = rows

    def kind_of(self, i: int) -> str:
        return "dense" if self.kinds["dense"].columns[i] is not None else "expert"

    def segment(self, matrices: dict[str, torch.Tensor], slot: int, i: int) -> torch.Tensor:
        """Parameter position ``i`` of ``slot`` in ``matrices`` (a view, shaped as the
        parameter)."""
        kind = self.kind_of(i)
        start = self.kinds[kind].columns[i]
        p = self.params[slot][i]
        return matrices[kind][slot, start : start + p.numel()].view(p.shape)

    def position(self, param: torch.nn.Parameter) -> tuple[int, int]:
        """(slot, position) of one of the slots' Parameters."""
        return self._positions[id(param)]

    def hold_parameters(self) -> None:
        """Move every slot's parameter values into matrices of this layout (the parameters'
        dtype) and point the layers' factor buffers at them; call again after anything
        re-pointed the parameters (:meth:`holds_parameters` says)."""
        first = self.params[0]
        dtype, device = first[0].dtype, first[0].device
        self.values = {
            name: torch.zeros(self.n, kind.width, dtype=dtype, device=device)
            for name, kind in self.kinds.items()
        }
        for buffer, params, rows in self._factor_buffers(self.values):
            buffer.realias(params, into=rows)
        self._held = [(p, p.data_ptr()) for p in (first[0], self.params[-1][-1])]

    def holds_parameters(self) -> bool:
        """Whether the slots' Parameters are still views of the parameter matrices (a
        conversion re-points every one of them: the first and the last are checked)."""
        return bool(self.values) and all(p.data_ptr() == ptr for p, ptr in self._held)

    def _factor_buffers(self, matrices: dict[str, torch.Tensor]) -> Iterator[tuple]:
        """Each layer's factor buffer, its slots' Parameters and their rows of ``matrices``
        (``[N, *shape]``)."""
        first = self.params[0]
        position = {id(p): i for i, p in enumerate(first)}
        for layer in multi_lora_modules(self.model):
            bank = layer.adapters
            for factor in FACTORS:
                buffer, params = bank.factor_buffers[factor], bank.params(factor)
                i = position[id(params[0])]
                start = self.kinds[self.kind_of(i)].columns[i]
                view = matrices[self.kind_of(i)][:, start : start + first[i].numel()]
                yield buffer, params, view.view(self.n, *first[i].shape)


def _accumulate(param: torch.Tensor) -> None:
    # Like megatron DDP with grad_reduce_in_fp32: micro-batch grads add up in fp32. (None:
    # the factor buffer's backward added this slot's gradient to main_grad itself.)
    if param.grad is not None:
        param.main_grad.add_(param.grad)
        param.grad = None


def _kind(params: list[torch.nn.Parameter], order: list[int]) -> Kind:
    columns: list[int | None] = [None] * len(params)
    at, partial_end = 0, 0
    for i in order:
        columns[i] = at
        at += -(-params[i].numel() // ALIGN) * ALIGN
        if is_partial(params[i]):
            partial_end = at
    return Kind(at, tuple(columns), partial_end)

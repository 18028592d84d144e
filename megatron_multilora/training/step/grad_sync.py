"""Per-slot gradient accumulation and reduction: megatron DDP + ``finalize_model_grads``, but
only for the slots that trained this step.

megatron's DistributedDataParallel keeps one gradient buffer for every trainable parameter
and all-reduces all of it every step, free slots included. Here each slot owns ranges of one
fp32 buffer that its parameters' ``main_grad`` are views of, a dense range
``[sequence-parallel | other]`` and an expert range, so neighbouring slots' ranges form one
span, reduced in place (separate spans are coalesced into one collective); slots left out of
:meth:`SlotGradSync.sync` (those without tokens in the step) cost no communication.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_multilora.layers.lifecycle import ModelOrChunks, num_adapter_slots, slot_parameters


def _accumulate(param: torch.Tensor) -> None:
    # Like megatron DDP with grad_reduce_in_fp32: micro-batch grads add up in fp32.
    param.main_grad.add_(param.grad)
    param.grad = None


def _is_partial(p: torch.nn.Parameter) -> bool:
    # A partial sum over this TP rank's sequence shard (see layers/sharding.py); expert
    # factors never are (experts are not tensor-split).
    return getattr(p, "sequence_parallel", False)


def _is_dense(p: torch.nn.Parameter) -> bool:
    return getattr(p, "allreduce", True)


class _SlotGrads:
    """One slot's fp32 gradient ranges, as ``(start, end)`` offsets into the shared buffer:
    ``dense`` (sequence-parallel partial sums first, ``partial``) and ``expert``."""

    def __init__(
        self, params: list[torch.nn.Parameter], buffer: torch.Tensor, dense_at: int, expert_at: int
    ) -> None:
        dense = sorted((p for p in params if _is_dense(p)), key=lambda p: not _is_partial(p))
        expert = [p for p in params if not _is_dense(p)]
        for group, offset in ((dense, dense_at), (expert, expert_at)):
            for p in group:
                p.main_grad = buffer[offset : offset + p.numel()].view_as(p)
                p.register_post_accumulate_grad_hook(_accumulate)
                offset += p.numel()
        self.dense = (dense_at, dense_at + sum(p.numel() for p in dense))
        self.partial = (dense_at, dense_at + sum(p.numel() for p in dense if _is_partial(p)))
        self.expert = (expert_at, expert_at + sum(p.numel() for p in expert))


class SlotGradSync:
    """fp32 ``main_grad`` for every adapter parameter of ``model``, reduced per slot.

    Backward adds each parameter's gradient into its ``main_grad`` and frees ``.grad``; a
    parameter that gets no gradient in a step keeps a zero ``main_grad``.

    All slots share one buffer laid out ``[slot 0 dense | slot 1 dense | ... | slot 0 expert
    | ...]``: neighbouring slots reduced together (all of them, in a full step) form one span
    that is reduced in place, without the copies of coalescing.
    """

    def __init__(self, model: ModelOrChunks) -> None:
        params = [slot_parameters(model, s) for s in range(num_adapter_slots(model))]
        dense = [sum(p.numel() for p in ps if _is_dense(p)) for ps in params]
        expert = [sum(p.numel() for p in ps if not _is_dense(p)) for ps in params]
        self._buffer = torch.zeros(
            sum(dense) + sum(expert), dtype=torch.float32, device=params[0][0].device
        )
        dense_at, expert_at = 0, sum(dense)
        self._slots = []
        for ps, n_dense, n_expert in zip(params, dense, expert):
            self._slots.append(_SlotGrads(ps, self._buffer, dense_at, expert_at))
            dense_at, expert_at = dense_at + n_dense, expert_at + n_expert

    def zero_grad(self, slots: Iterable[int]) -> None:
        """Zero the given slots' ``main_grad`` (before a step's first backward)."""
        chosen = [self._slots[s] for s in slots]
        for ranges in ([g.dense for g in chosen], [g.expert for g in chosen]):
            for span in self._spans(ranges):
                span.zero_()

    def save(self, slots: Iterable[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the given slots' gradients (their buffer ranges), for :meth:`load`."""
        out = []
        for s in slots:
            for start, end in (self._slots[s].dense, self._slots[s].expert):
                view = self._buffer[start:end]
                out.append((view, view.clone()))
        return out

    def load(self, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put gradients :meth:`save` copied back."""
        for view, copy in saved:
            view.copy_(copy)

    def sync(self, slots: Iterable[int]) -> None:
        """Reduce the given slots' gradients as megatron DDP + ``finalize_model_grads`` would
        with ``calculate_per_token_loss=True``; every rank must pass the same slots.

        Dense gradients are summed (losses are already normalised per token over the global
        batch, see training/step.py) over the data-parallel group, expert ones over the
        expert-data-parallel group; then sequence-parallel partial gradients are summed over
        the tensor-parallel group, in finalize_model_grads' order. One collective per group
        for all the given slots, covering every model chunk (pipeline stages hold disjoint
        layers, so no reduction over the pipeline group). finalize_model_grads' other steps
        do not apply: its embedding and conditional-embedder syncs across pipeline stages
        touch only the frozen base, there is no context parallelism, and the base, including
        routers and their expert bias, is frozen.
        """
        chosen = [self._slots[s] for s in slots]
        _all_reduce(
            self._spans([g.dense for g in chosen]), parallel_state.get_data_parallel_group()
        )
        _all_reduce(
            self._spans([g.expert for g in chosen]), parallel_state.get_expert_data_parallel_group()
        )
        _all_reduce(
            self._spans([g.partial for g in chosen]),
            parallel_state.get_tensor_model_parallel_group(),
        )

    def _spans(self, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
        """The ranges as buffer views, adjacent ones merged (in order; the same elements in
        the same order as the ranges coalesced, so the reduction sums alike)."""
        merged: list[list[int]] = []
        for start, end in ranges:
            if merged and merged[-1][1] == start:
                merged[-1][1] = end
            else:
                merged.append([start, end])
        return [self._buffer[start:end] for start, end in merged]


def _all_reduce(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum the tensors over ``group`` in one collective; nothing on a group of one."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors or dist.get_world_size(group) == 1:
        return
    if len(tensors) == 1:
        dist.all_reduce(tensors[0], group=group)
        return
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    for t, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(synced)

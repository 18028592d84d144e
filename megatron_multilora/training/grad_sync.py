"""Per-slot gradient accumulation and reduction: megatron DDP + ``finalize_model_grads``, but
only for the slots that trained this step.

megatron's DistributedDataParallel keeps one gradient buffer for every trainable parameter
and all-reduces all of it every step, free slots included. Here each slot owns an fp32
buffer that its parameters' ``main_grad`` are views of, laid out as
``[sequence-parallel dense | other dense | expert]``, so each reduction is one contiguous
range per slot, coalesced over the slots being reduced; slots left out of
:meth:`SlotGradSync.sync` (those without tokens in the step) cost no communication.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_multilora.layers.lifecycle import ModelOrChunks, num_adapter_slots, slot_parameters


def _accumulate(param: torch.Tensor) -> None:
    # Like megatron DDP with grad_reduce_in_fp32: micro-batch grads add up in fp32.
    param.main_grad.add_(param.grad)
    param.grad = None


class _SlotGrads:
    """One slot's fp32 gradient buffer and the ranges each reduction covers."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        def partial(p: torch.nn.Parameter) -> bool:
            # A partial sum over this TP rank's sequence shard (see layers/sharding.py);
            # expert factors never are (experts are not tensor-split).
            return getattr(p, "sequence_parallel", False)

        dense = sorted((p for p in params if getattr(p, "allreduce", True)),
                       key=lambda p: not partial(p))
        expert = [p for p in params if not getattr(p, "allreduce", True)]
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32,
                                  device=params[0].device)
        offset = 0
        for p in dense + expert:
            p.main_grad = self.buffer[offset:offset + p.numel()].view_as(p)
            p.register_post_accumulate_grad_hook(_accumulate)
            offset += p.numel()
        n_dense = sum(p.numel() for p in dense)
        self.partial = self.buffer[:sum(p.numel() for p in dense if partial(p))]
        self.dense = self.buffer[:n_dense]
        self.expert = self.buffer[n_dense:]


class SlotGradSync:
    """fp32 ``main_grad`` for every adapter parameter of ``model``, reduced per slot.

    Backward adds each parameter's gradient into its ``main_grad`` and frees ``.grad``; a
    parameter that gets no gradient in a step keeps a zero ``main_grad``.
    """

    def __init__(self, model: ModelOrChunks) -> None:
        self._slots = [_SlotGrads(slot_parameters(model, s)) for s in range(num_adapter_slots(model))]

    def zero_grad(self, slots: Iterable[int]) -> None:
        """Zero the given slots' ``main_grad`` (before a step's first backward)."""
        for s in slots:
            self._slots[s].buffer.zero_()

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
        _all_reduce([g.dense for g in chosen], parallel_state.get_data_parallel_group())
        _all_reduce([g.expert for g in chosen], parallel_state.get_expert_data_parallel_group())
        _all_reduce([g.partial for g in chosen],
                    parallel_state.get_tensor_model_parallel_group())


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

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

import dataclasses
from collections.abc import Iterable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_multilora.training.step.slot_rows import SlotRows, is_tp_split


class SlotGradSync:
    """Reduction of ``rows``' gradient matrices (every adapter parameter's ``main_grad``),
    per slot; a parameter that gets no gradient in a step keeps a zero ``main_grad``.

    Neighbouring slots reduced together (all of them, in a full step) form one span of the
    buffer, reduced in place without the copies of coalescing.
    """

    def __init__(self, rows: SlotRows) -> None:
        self.rows = rows
        self._buffer = rows.grad_buffer
        wd, we = rows.kinds["dense"].width, rows.kinds["expert"].width
        at = rows.n * wd
        self._slots = [
            _SlotGrads(
                (s * wd, (s + 1) * wd),
                (s * wd, s * wd + rows.kinds["dense"].partial_end),
                (at + s * we, at + (s + 1) * we),
            )
            for s in range(rows.n)
        ]

        # Each dense column range's share of its slot's squared norm: TP-split factors add
        # their shards over the TP group; replicated ones (identical on every TP rank) count
        # once. SlotRows groups the columns by kind, so these are a few ranges.
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self._norm_ranges: list[tuple[int, int, float]] = []
        for i, p in sorted(
            ((i, p) for i, p in enumerate(rows.params[0]) if rows.kind_of(i) == "dense"),
            key=lambda ip: rows.kinds["dense"].columns[ip[0]],
        ):
            start = rows.kinds["dense"].columns[i]
            end, share = start + p.numel(), 1.0 if is_tp_split(p) else 1.0 / tp
            if self._norm_ranges and self._norm_ranges[-1][2] == share:
                start = self._norm_ranges.pop()[0]  # alignment gaps hold zeros: joined
            self._norm_ranges.append((start, end, share))

    def norms(self) -> torch.Tensor:
        """The L2 norm of each slot's whole gradient, ``[N]`` on the gradients' device (the
        same on every rank), over all its TP and EP shards and pipeline stages, so clipping
        uses the adapter's global norm: a few ops for all slots, each row reduced as it would
        be alone, no temporary the size of the gradients (on the CPU a fresh one costs its
        page faults every step) and no read back to the host."""
        grads = self.rows.grads
        dense = torch.zeros(self.rows.n, dtype=torch.float32, device=self._buffer.device)
        for start, end, share in self._norm_ranges:
            squares = torch.linalg.vector_norm(grads["dense"][:, start:end], dim=1).square()
            dense += squares if share == 1.0 else squares * share
        experts = torch.linalg.vector_norm(grads["expert"], dim=1).square()
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(dense, group=parallel_state.get_tensor_model_parallel_group())
        if parallel_state.get_expert_model_parallel_world_size() > 1:
            dist.all_reduce(experts, group=parallel_state.get_expert_model_parallel_group())
        total = dense + experts
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        return total.sqrt()

    def zero_grad(self, slots: Iterable[int]) -> None:
        """Zero the given slots' ``main_grad`` (before a step's first backward)."""
        chosen = [self._slots[s] for s in sorted(slots)]
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
        chosen = [self._slots[s] for s in sorted(slots)]
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


@dataclasses.dataclass(frozen=True)
class _SlotGrads:
    """One slot's ranges of the gradient buffer, as ``(start, end)`` offsets: ``dense``, its
    sequence-parallel partial sums (``partial``, at the dense range's start) and ``expert``."""

    dense: tuple[int, int]
    partial: tuple[int, int]
    expert: tuple[int, int]

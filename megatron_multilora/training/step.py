"""One training step over a rank's packed micro-batches, with per-adapter loss normalisation.

An adapter's loss is the mean over *its own* loss tokens in its global batch (all
micro-batches, all data-parallel ranks): its gradients do not depend on which other adapters
share the micro-batches. The per-adapter token counts are agreed before the backward passes,
and gradients are summed (not averaged) over data-parallel ranks (see grad_sync.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_multilora.data.packing import MicroBatch, pad_micro_batch


def global_loss_tokens(micro_batches: list[MicroBatch], n_slots: int) -> torch.Tensor:
    """``[n_slots]`` loss tokens per adapter over this step's whole global batch."""
    local = torch.zeros(n_slots, dtype=torch.int64)
    for mb in micro_batches:
        local += mb.loss_tokens_per_slot()
    if parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
    return local


def equalize_micro_batches(micro_batches: list[MicroBatch], filler: MicroBatch) -> list[MicroBatch]:
    """Pad every data-parallel rank to the same number of micro-batches with a loss-free
    filler (expert-parallel collectives run once per forward on every rank), then align
    them with the expert-parallel peers (:func:`align_with_expert_peers`, padding with the
    filler's pad token)."""
    count = torch.tensor([len(micro_batches)])
    if parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
    padded = micro_batches + [filler] * (int(count) - len(micro_batches))
    return align_with_expert_peers(padded, pad_id=int(filler.tokens[0, 0]))


def align_with_expert_peers(micro_batches: list[MicroBatch], pad_id: int) -> list[MicroBatch]:
    """Under expert parallelism, pad each micro-batch to the length of the longest one the
    other expert-parallel ranks run alongside it, and record in ``ep_slots`` the slots with
    positions in any of them; one collective per call. Every expert-parallel rank must pass
    the same number of micro-batches.

    The allgather dispatcher needs equal token counts on every rank of its TP x EP group;
    tensor-parallel peers already share their micro-batches, so the EP group is the one to
    align. The pads change no adapter's gradient (see :func:`_run_micro_batch`); ``ep_slots``
    lets the expert layers run their GEMMs over the slots whose rows can reach them only.
    """
    group = parallel_state.get_expert_model_parallel_group()
    if dist.get_world_size(group) == 1 or not micro_batches:
        return micro_batches
    table = torch.zeros(len(micro_batches), 1 + len(micro_batches[0].counts), dtype=torch.int64)
    for row, mb in zip(table, micro_batches):
        row[0] = mb.tokens.size(1)
        row[1:] = torch.tensor(mb.counts) > 0
    dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
    return [dataclasses.replace(pad_micro_batch(mb, int(row[0]), pad_id),
                                ep_slots=tuple(row[1:].nonzero().flatten().tolist()))
            for mb, row in zip(micro_batches, table)]


def forward_backward(model: torch.nn.Module, micro_batches: list[MicroBatch],
                     denominators: torch.Tensor, backward: bool = True) -> torch.Tensor:
    """Run the micro-batches; returns each adapter's summed normalised loss on this rank.

    Token t of slot s weighs ``loss_mask_t / denominators[s]`` (0 where a slot has no loss
    tokens), so summed over ranks each adapter's value is its mean token loss.
    """
    n_slots = denominators.numel()
    device = next(model.parameters()).device
    weight_per_slot = torch.where(denominators > 0, 1.0 / denominators.clamp(min=1).double(),
                                  torch.zeros((), dtype=torch.float64)).float().to(device)
    per_slot = torch.zeros(n_slots, dtype=torch.float64, device=device)
    with torch.enable_grad() if backward else torch.no_grad():
        for mb in micro_batches:
            _run_micro_batch(model, mb.to(device), weight_per_slot, per_slot, backward)
    return per_slot.cpu()  # read back once per step, not per micro-batch


def _run_micro_batch(model, mb: MicroBatch, weight_per_slot: torch.Tensor,
                     per_slot: torch.Tensor, backward: bool) -> None:
    # Pads carry no loss, and megatron's padding mask keeps them out of MoE routers'
    # auxiliary losses, through which they would otherwise change adapters' gradients. A
    # micro-batch of pads only (a filler) cannot be masked (the aux loss would be 0/0): its
    # aux-loss gradient is scaled to zero instead, so it trains nothing.
    only_pads = mb.n_pad == mb.tokens.size(1)
    token_loss = model(mb.tokens, mb.position_ids, None, labels=mb.labels,
                       packed_seq_params=mb.packed_seq_params(),
                       padding_mask=None if only_pads else mb.padding_mask())
    slot_of_token = torch.repeat_interleave(torch.arange(len(mb.counts)), torch.tensor(mb.counts),
                                            output_size=sum(mb.counts)).to(mb.tokens.device)
    weights = mb.loss_mask[0] * weight_per_slot[slot_of_token]
    # where(): a token that does not count (padding, prompt) must not carry a non-finite loss
    # into its slot's sum.
    contrib = torch.where(weights > 0, token_loss[0].float() * weights, torch.zeros((), device=weights.device))
    per_slot.index_add_(0, slot_of_token, contrib.detach().double())
    if backward:
        with _aux_loss_gradient_scaled(0.0 if only_pads else None):
            contrib.sum().backward()


@contextlib.contextmanager
def _aux_loss_gradient_scaled(scale: Optional[float]) -> Iterator[None]:
    """Within, megatron's MoE auxiliary losses back-propagate times ``scale`` (None: as set)."""
    if scale is None:
        yield
        return
    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(float(scale))
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved


def reduce_losses(per_slot: torch.Tensor) -> torch.Tensor:
    """Sum per-adapter losses over data-parallel ranks (each rank held part of the batch)."""
    if parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(per_slot, group=parallel_state.get_data_parallel_group())
    return per_slot


def filler_micro_batch(n_slots: int, pad_multiple: int, pad_id: int) -> MicroBatch:
    """A loss-free micro-batch of ``pad_multiple`` pad tokens."""
    s = max(1, pad_multiple)
    pads = torch.full((1, s), pad_id, dtype=torch.int64)
    return MicroBatch(tokens=pads, labels=pads.clone(), loss_mask=torch.zeros(1, s),
                      position_ids=torch.arange(s).view(1, s),
                      counts=[s] + [0] * (n_slots - 1), examples_per_slot=[0] * n_slots,
                      seq_lengths=[s], n_pad=s)

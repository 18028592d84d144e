"""One training step of N adapters at once, with per-adapter loss normalisation.

pack -> agree the micro-batch count, each adapter's loss-token count, the stop signal and any
pending job requests (one collective) -> forward/backward through megatron's schedule
(training/schedule.py) -> per-slot gradient sync (the loss reduction overlapping it) ->
per-slot gradient norms (over every TP/EP shard and pipeline stage, all slots at once) ->
non-finite isolation -> each slot's clipped optimizer step.

An adapter's loss is the mean over *its own* loss tokens in its global batch (all
micro-batches, all data-parallel ranks): its gradients do not depend on which other adapters
share the micro-batches. The per-adapter token counts are agreed before the backward passes,
and gradients are summed (not averaged) over data-parallel ranks (see grad_sync.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_multilora.data.datasets import Example
from megatron_multilora.data.packing import MicroBatch, pack_micro_batches, pad_micro_batch
from megatron_multilora.layers.lifecycle import ModelOrChunks
from megatron_multilora.parallel import collective_device
from megatron_multilora.training.grad_sync import SlotGradSync
from megatron_multilora.training.schedule import micro_batch_multiple, model_chunks, per_slot_losses
from megatron_multilora.training.slot_optimizer import SlotOptimizer, slot_grad_norms


def global_loss_tokens(micro_batches: list[MicroBatch], n_slots: int) -> torch.Tensor:
    """``[n_slots]`` loss tokens per adapter over this step's whole global batch (the
    agreement :func:`agree_step` reaches; every rank of the world calls it)."""
    return agree_step(micro_batches, n_slots).loss_tokens


@dataclasses.dataclass
class StepAgreement:
    """What every rank agreed on before a step: the most micro-batches any data-parallel peer
    packed, each adapter's loss tokens over the data-parallel group (``[n_slots]`` int64),
    the largest stop signal any rank of the world received (0: none) and the largest count
    of pending job requests any rank saw (training/job_inbox.py; 0: none)."""

    micro_batches: int
    loss_tokens: torch.Tensor
    stop_signal: int
    requests: int = 0


def agree_step(micro_batches: list[MicroBatch], n_slots: int, stop_signal: int = 0,
               requests: int = 0) -> StepAgreement:
    """One collective over the whole world instead of one per question: each rank writes
    its own row (stop signal, requests, micro-batch count, loss tokens per slot) of a zeroed
    ``[world, 3 + n_slots]`` table and the table is summed, so every rank reads every row
    (exact, integers) and takes its data-parallel peers' max count and token sums, and the
    world's largest signal and request count. Every rank of the world must call it."""
    row = torch.zeros(3 + n_slots, dtype=torch.int64)
    row[0], row[1], row[2] = stop_signal, requests, len(micro_batches)
    for mb in micro_batches:
        row[3:] += mb.loss_tokens_per_slot()
    if dist.get_world_size() == 1:
        return StepAgreement(int(row[2]), row[3:], int(row[0]), int(row[1]))
    table = torch.zeros(dist.get_world_size(), row.numel(), dtype=torch.int64)
    table[dist.get_rank()] = row
    table = table.to(collective_device())
    dist.all_reduce(table)
    table = table.cpu()
    peers = table[dist.get_process_group_ranks(parallel_state.get_data_parallel_group())]
    return StepAgreement(int(peers[:, 2].max()), peers[:, 3:].sum(0), int(table[:, 0].max()),
                         int(table[:, 1].max()))


def agree_boundary(stop_signal: int, requests: int) -> tuple[int, int]:
    """At a step boundary no step agreed on (collective over the world): the largest stop
    signal and the largest request count of any rank."""
    agreed = agree_step([], 0, stop_signal, requests)
    return agreed.stop_signal, agreed.requests


def equalize_micro_batches(micro_batches: list[MicroBatch], filler: MicroBatch,
                           count_multiple: int = 1, count: Optional[int] = None) -> list[MicroBatch]:
    """Make this rank's micro-batches runnable in lockstep with the other ranks.

    Pad every data-parallel rank to the same number of micro-batches (rounded up to
    ``count_multiple``, see ``schedule.micro_batch_multiple``) with a loss-free filler
    (expert-parallel collectives run once per forward on every rank); align them with the
    expert-parallel peers (:func:`align_with_expert_peers`); under pipeline parallelism pad
    every one to the longest (one p2p tensor shape per step). Pads use the filler's token.
    ``count``: the most micro-batches of any data-parallel peer when already agreed
    (:func:`agree_step`); else agreed here over the data-parallel group (evaluation and
    generation call this per forward: no world collective, none without data parallelism).
    """
    if count is None:
        most = torch.tensor([len(micro_batches)], device=collective_device())
        if parallel_state.get_data_parallel_world_size() > 1:
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
        count = int(most)
    target = -(-count // count_multiple) * count_multiple
    pad_id = int(filler.tokens[0, 0])
    padded = align_with_expert_peers(micro_batches + [filler] * (target - len(micro_batches)),
                                     pad_id)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1 and padded:
        # Every stage of a pipeline holds the same micro-batches (and, after the alignment,
        # expert-parallel peers the same lengths), so all agree on this length.
        length = max(mb.tokens.size(1) for mb in padded)
        padded = [pad_micro_batch(mb, length, pad_id) for mb in padded]
    return padded


def align_with_expert_peers(micro_batches: list[MicroBatch], pad_id: int) -> list[MicroBatch]:
    """Under expert parallelism, pad each micro-batch to the length of the longest one the
    other expert-parallel ranks run alongside it, and record in ``ep_slots`` the slots with
    positions in any of them; one collective per call. Every expert-parallel rank must pass
    the same number of micro-batches.

    The allgather dispatcher needs equal token counts on every rank of its TP x EP group;
    tensor-parallel peers already share their micro-batches, so the EP group is the one to
    align. The pads change no adapter's gradient (see ``schedule.run_schedule``);
    ``ep_slots`` lets the expert layers run their GEMMs over the slots whose rows can reach
    them only.
    """
    group = parallel_state.get_expert_model_parallel_group()
    if dist.get_world_size(group) == 1 or not micro_batches:
        return micro_batches
    table = torch.zeros(len(micro_batches), 1 + len(micro_batches[0].counts), dtype=torch.int64)
    for row, mb in zip(table, micro_batches):
        row[0] = mb.tokens.size(1)
        row[1:] = torch.tensor(mb.counts) > 0
    table = table.to(collective_device())
    dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
    table = table.cpu()
    return [dataclasses.replace(pad_micro_batch(mb, int(row[0]), pad_id),
                                ep_slots=tuple(row[1:].nonzero().flatten().tolist()))
            for mb, row in zip(micro_batches, table)]


def reduce_losses(per_slot: torch.Tensor) -> torch.Tensor:
    """Sum per-adapter losses over data-parallel ranks (each rank held part of the batch)."""
    return start_reducing_losses(per_slot)()


def start_reducing_losses(per_slot: torch.Tensor) -> Callable[[], torch.Tensor]:
    """:func:`reduce_losses`, started without waiting (the step overlaps it with the gradient
    reduction, so the two cost the ranks one meeting); call the result for the losses."""
    if parallel_state.get_data_parallel_world_size() == 1:
        return per_slot.cpu
    per_slot = per_slot.to(collective_device())
    work = dist.all_reduce(per_slot, group=parallel_state.get_data_parallel_group(), async_op=True)

    def reduced() -> torch.Tensor:
        work.wait()
        return per_slot.cpu()

    return reduced


def filler_micro_batch(n_slots: int, pad_multiple: int, pad_id: int) -> MicroBatch:
    """A loss-free micro-batch of ``pad_multiple`` pad tokens."""
    s = max(1, pad_multiple)
    pads = torch.full((1, s), pad_id, dtype=torch.int64)
    return MicroBatch(tokens=pads, labels=pads.clone(), loss_mask=torch.zeros(1, s),
                      position_ids=torch.arange(s).view(1, s),
                      counts=[s] + [0] * (n_slots - 1), examples_per_slot=[0] * n_slots,
                      seq_lengths=[s], n_pad=s)


@dataclasses.dataclass
class StepResult:
    """What one step did: every adapter's loss over its global batch (``[n_slots]``, the
    same on every rank), the gradient norm of each slot that stepped, the slots skipped for a
    non-finite loss or gradient, each adapter's loss tokens (``[n_slots]``), and the stop
    signal and job request count agreed before the step (:func:`agree_step`; 0: none)."""

    losses: torch.Tensor
    grad_norms: dict[int, float]
    skipped: set[int]
    loss_tokens: torch.Tensor
    stop_signal: int = 0
    requests: int = 0


class SlotTrainStep:
    """The training step of every adapter slot of ``model`` (a model or its chunks).

    Packs each slot's examples into micro-batches of at most ``token_budget`` positions
    (padded to a multiple of ``pad_multiple``, e.g. the sequence-parallel size) and runs
    :meth:`__call__`. Owns the slots' fp32 gradient buffers (:class:`SlotGradSync`).
    """

    def __init__(self, model: ModelOrChunks, n_slots: int, token_budget: int, pad_multiple: int,
                 pad_id: int) -> None:
        self.model = model_chunks(model)
        self.n_slots, self.token_budget = n_slots, token_budget
        self.pad_multiple, self.pad_id = pad_multiple, pad_id
        self.grad_sync = SlotGradSync(self.model)
        self.filler = filler_micro_batch(n_slots, pad_multiple, pad_id)

    def pack(self, slot_examples: Sequence[Sequence[Example]], exclude: Iterable[int] = (),
             slot_order: Optional[Sequence[int]] = None) -> list[MicroBatch]:
        """This rank's micro-batches of every slot's examples but ``exclude``'s, ready to run
        (:func:`equalize_micro_batches`); ``slot_order`` as in ``pack_micro_batches``."""
        return self._equalize(self._pack_local(slot_examples, exclude, slot_order))

    def _pack_local(self, slot_examples: Sequence[Sequence[Example]], exclude: Iterable[int],
                    slot_order: Optional[Sequence[int]]) -> list[MicroBatch]:
        skip = set(exclude)
        kept = [[] if s in skip else examples for s, examples in enumerate(slot_examples)]
        return pack_micro_batches(kept, self.token_budget, self.pad_multiple, self.pad_id,
                                  slot_order=slot_order)

    def _equalize(self, micro_batches: list[MicroBatch], count: Optional[int] = None
                  ) -> list[MicroBatch]:
        return equalize_micro_batches(micro_batches, self.filler, micro_batch_multiple(self.model),
                                      count)

    def losses(self, micro_batches: list[MicroBatch], loss_tokens: torch.Tensor,
               forward_only: bool = False) -> torch.Tensor:
        """Each adapter's loss over the global batch (reduced over data-parallel ranks, on
        every stage); with ``forward_only=False`` its gradients accumulate in ``main_grad``."""
        return reduce_losses(per_slot_losses(self.model, micro_batches, loss_tokens, forward_only))

    def __call__(self, slot_examples: Sequence[Sequence[Example]],
                 optimizers: dict[int, SlotOptimizer], slot_order: Optional[Sequence[int]] = None,
                 micro_batches: Optional[list[MicroBatch]] = None,
                 stop_signal: int = 0, requests: int = 0) -> StepResult:
        """One step of the slots in ``optimizers`` on this rank's ``slot_examples`` (its
        data-parallel share of each slot's global batch); ``micro_batches``: their
        :meth:`pack` when already done. ``stop_signal`` (this rank's, 0: none) and
        ``requests`` (job requests this rank saw, see training/job_inbox.py) are agreed over
        all ranks in the step's first collective (see training/stop.py). Every rank of the
        world must call it.

        A slot whose loss or gradient norm is not finite is left out: the step is redone
        without the adapters found to fail on their own samples, and they do not step.
        Every rank takes the same decisions (losses come from the last stage, norms are
        global).
        """
        # Packing, loss-token and stop agreements share one collective (fillers and pads
        # carry no loss tokens, so the unpadded micro-batches count the same).
        if micro_batches is None:
            local = self._pack_local(slot_examples, (), slot_order)
            agreed = agree_step(local, self.n_slots, stop_signal, requests)
            micro_batches = self._equalize(local, agreed.micro_batches)
        else:
            agreed = agree_step(micro_batches, self.n_slots, stop_signal, requests)
        loss_tokens = agreed.loss_tokens
        skipped: set[int] = set()
        while True:
            # Only the training slots' gradients are reset and reduced: free slots cost nothing.
            self.grad_sync.zero_grad(optimizers)
            reduced_losses = start_reducing_losses(
                per_slot_losses(self.model, micro_batches, loss_tokens))
            stepping = [s for s in optimizers if s not in skipped]
            self.grad_sync.sync(stepping)
            losses = reduced_losses()
            norms = slot_grad_norms({s: optimizers[s].params for s in stepping})
            failing = {s for s, norm in norms.items()
                       if not (math.isfinite(norm) and math.isfinite(float(losses[s])))}
            if not failing:
                break
            # A non-finite adapter can poison the others through masked attention (0 * inf):
            # find which fail on their own samples, and redo the step without them.
            skipped |= self._failing_alone(slot_examples, loss_tokens, failing, slot_order)
            micro_batches = self.pack(slot_examples, skipped, slot_order)
        for s in stepping:
            optimizers[s].step(norms[s])
        return StepResult(losses, norms, skipped, loss_tokens, agreed.stop_signal,
                          agreed.requests)

    def _failing_alone(self, slot_examples: Sequence[Sequence[Example]], loss_tokens: torch.Tensor,
                       candidates: set[int], slot_order: Optional[Sequence[int]]) -> set[int]:
        """The candidates whose loss is non-finite on their own samples (all of them when
        none is, i.e. only their combination fails)."""
        culprits = set()
        for slot in sorted(candidates):
            alone = self.pack(slot_examples, set(range(self.n_slots)) - {slot}, slot_order)
            if not math.isfinite(float(self.losses(alone, loss_tokens, forward_only=True)[slot])):
                culprits.add(slot)
        return culprits or set(candidates)

"""Micro-batches ready to run, for every consumer (the training step, evaluation, generation).

From each slot's examples to what a model chunk is called with, in one place:

1. **pack** (``data/packing.py``): adapter-major single-sequence micro-batches under a token
   budget, each padded to a multiple of the sequence-parallel size;
2. **agree** (training): one collective over the world settles the most micro-batches any
   data-parallel peer packed, each slot's loss units over its global batch, and the caller's
   extra integers (e.g. a stop signal); evaluation and generation agree their count over the
   data-parallel group only;
3. **equalise**: loss-free fillers up to the agreed count (rounded up to the interleaved
   schedule's group), each micro-batch padded to the longest one its expert-parallel peers run
   alongside it (recording in ``ep_slots`` the slots whose rows can reach this rank's experts)
   and, under pipelining, to one length for all (one p2p tensor shape per step);
4. **chunk inputs**: tokens, positions, labels, megatron's MoE padding mask (split over
   sequence-parallel ranks after the first stage) and the ``thd`` packing description carrying
   the slot layout to the adapted layers (:func:`~megatron_multilora.layers.slot_layout_route.with_slot_layout`).

Pads carry no loss and attend only among themselves, so none of this changes any adapter's
gradient (see ``schedule.run_schedule`` for the MoE auxiliary loss).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_multilora.data.datasets import Packable
from megatron_multilora.data.packing import MicroBatch, pack_micro_batches, pad_micro_batch
from megatron_multilora.layers.lifecycle import ModelOrChunks, model_chunks
from megatron_multilora.layers.slot_layout_route import with_slot_layout
from megatron_multilora.parallel import collective_device


@dataclasses.dataclass
class Agreement:
    """What every rank agreed on before a step: the most micro-batches any data-parallel peer
    packed, each slot's loss units over the data-parallel group (``[n_slots]`` int64), and
    the largest value any rank of the world gave for each of the caller's extras."""

    micro_batches: int
    loss_units: torch.Tensor
    extras: tuple[int, ...] = ()


def agree(micro_batches: list[MicroBatch], n_slots: int, extras: Sequence[int] = ()) -> Agreement:
    """One collective over the whole world instead of one per question: each rank writes its
    own row (extras, micro-batch count, loss units per slot) of a zeroed table that is summed,
    so every rank reads every row (exact integers) and takes its data-parallel peers' max count
    and token sums and the world's max of each extra. Every rank of the world must call it."""
    k = len(extras)
    row = torch.zeros(k + 1 + n_slots, dtype=torch.int64)
    row[:k] = torch.tensor(list(extras), dtype=torch.int64)
    row[k] = len(micro_batches)
    for mb in micro_batches:
        row[k + 1 :] += mb.loss_units_per_slot()
    alone = parallel_state.get_data_parallel_world_size() == 1 and not extras
    if dist.get_world_size() == 1 or alone:  # no peer's counts or extras to take
        return Agreement(int(row[k]), row[k + 1 :], tuple(int(v) for v in row[:k]))
    table = torch.zeros(dist.get_world_size(), row.numel(), dtype=torch.int64)
    table[dist.get_rank()] = row
    table = table.to(collective_device())
    dist.all_reduce(table)
    table = table.cpu()
    peers = table[dist.get_process_group_ranks(parallel_state.get_data_parallel_group())]
    most = tuple(int(v) for v in table[:, :k].max(0).values) if k else ()
    return Agreement(int(peers[:, k].max()), peers[:, k + 1 :].sum(0), most)


def micro_batch_multiple(model: ModelOrChunks) -> int:
    """What a call's micro-batch count must be a multiple of: with virtual pipeline stages
    the interleaved schedule runs micro-batches in groups of
    ``microbatch_group_size_per_vp_stage`` (megatron's default: the PP size); else 1."""
    chunks = model_chunks(model)
    return chunks[0].config.microbatch_group_size_per_vp_stage if len(chunks) > 1 else 1


def filler_micro_batch(n_slots: int, pad_multiple: int, pad_id: int) -> MicroBatch:
    """A loss-free micro-batch of ``pad_multiple`` pad tokens."""
    s = max(1, pad_multiple)
    pads = torch.full((1, s), pad_id, dtype=torch.int64)
    return MicroBatch(
        tokens=pads,
        labels=pads.clone(),
        loss_mask=torch.zeros(1, s),
        position_ids=torch.arange(s).view(1, s),
        counts=[s] + [0] * (n_slots - 1),
        examples_per_slot=[0] * n_slots,
        seq_lengths=[s],
        n_pad=s,
    )


class MicroBatcher:
    """Packs and equalises the micro-batches of ``n_slots`` slots for one model (its chunks):
    at most ``token_budget`` positions each, padded to ``pad_multiple`` (the
    sequence-parallel size) with ``pad_id``, and with ``lengths`` (CUDA graphs: shapes that
    repeat) to the shortest of them that holds it."""

    def __init__(
        self,
        model: ModelOrChunks,
        n_slots: int,
        token_budget: int,
        pad_multiple: int,
        pad_id: int,
        lengths: Sequence[int] = (),
    ) -> None:
        self.n_slots, self.token_budget = n_slots, token_budget
        self.pad_multiple, self.pad_id = pad_multiple, pad_id
        self.lengths = tuple(sorted(lengths))
        self.count_multiple = micro_batch_multiple(model)
        self.filler = filler_micro_batch(n_slots, pad_multiple, pad_id)

    def pack(
        self,
        slot_examples: Sequence[Sequence[Packable]],
        exclude: Iterable[int] = (),
        slot_order: Sequence[int] | None = None,
    ) -> list[MicroBatch]:
        """This rank's micro-batches of every slot's examples but ``exclude``'s, before any
        agreement (``slot_order`` as in ``pack_micro_batches``)."""
        skip = set(exclude)
        kept = [[] if s in skip else examples for s, examples in enumerate(slot_examples)]
        return pack_micro_batches(
            kept, self.token_budget, self.pad_multiple, self.pad_id, slot_order=slot_order
        )

    def ready(
        self,
        slot_examples: Sequence[Sequence[Packable]],
        exclude: Iterable[int] = (),
        slot_order: Sequence[int] | None = None,
    ) -> list[MicroBatch]:
        """Packed and equalised, the count agreed over the data-parallel group."""
        return self.equalize(self.pack(slot_examples, exclude, slot_order))

    def equalize(
        self, micro_batches: list[MicroBatch], count: int | None = None
    ) -> list[MicroBatch]:
        """Make this rank's micro-batches runnable in lockstep with the other ranks (step 3 of
        the module docstring). ``count``: the most micro-batches of any data-parallel peer
        when already agreed (:func:`agree`); else agreed here over the data-parallel group (no
        collective without data parallelism)."""
        if count is None:
            most = torch.tensor([len(micro_batches)], device=collective_device())
            if parallel_state.get_data_parallel_world_size() > 1:
                dist.all_reduce(
                    most, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group()
                )
            count = int(most)
        target = -(-count // self.count_multiple) * self.count_multiple
        padded = align_with_expert_peers(
            micro_batches + [self.filler] * (target - len(micro_batches)), self.pad_id
        )
        if parallel_state.get_pipeline_model_parallel_world_size() > 1 and padded:
            # Every stage of a pipeline holds the same micro-batches (and, after the alignment,
            # expert-parallel peers the same lengths), so all agree on this length.
            length = max(mb.tokens.size(1) for mb in padded)
            padded = [pad_micro_batch(mb, length, self.pad_id) for mb in padded]
        if self.lengths:
            padded = [pad_micro_batch(mb, self._fixed_length(mb), self.pad_id) for mb in padded]
        return padded

    def _fixed_length(self, mb: MicroBatch) -> int:
        size = mb.tokens.size(1)
        for length in self.lengths:
            if length >= size:
                return length
        raise ValueError(
            f"a micro-batch of {size} positions is longer than the longest fixed length "
            f"{self.lengths[-1]} (the token budget {self.token_budget}, rounded up)"
        )


def align_with_expert_peers(micro_batches: list[MicroBatch], pad_id: int) -> list[MicroBatch]:
    """Under expert parallelism, pad each micro-batch to the length of the longest one the
    other expert-parallel ranks run alongside it, and record in ``ep_slots`` the slots with
    positions in any of them; one collective per call. Every expert-parallel rank must pass
    the same number of micro-batches.

    The allgather dispatcher needs equal token counts on every rank of its TP x EP group;
    tensor-parallel peers already share their micro-batches, so the EP group is the one to
    align; ``ep_slots`` lets the expert layers run their GEMMs over the slots whose rows can
    reach them only.
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
    return [
        dataclasses.replace(
            pad_micro_batch(mb, int(row[0]), pad_id),
            ep_slots=tuple(row[1:].nonzero().flatten().tolist()),
        )
        for mb, row in zip(micro_batches, table)
    ]


def chunk_inputs(chunk: torch.nn.Module, mb: MicroBatch) -> dict[str, Any]:
    """What ``chunk`` is called with for ``mb`` (already on its device), but the labels."""
    only_pads = mb.n_pad == mb.tokens.size(1)
    # Pads carry no loss, and megatron's padding mask keeps them out of MoE routers'
    # auxiliary losses, the only thing routers read it for (but counting tokens for an
    # expert-bias update, which this frozen base never makes and megatron 0.16.1 breaks on
    # with a mask). A micro-batch of pads only (a filler) cannot be masked (its aux loss
    # would be 0/0): the schedule scales its aux-loss gradient to zero instead.
    masked = not only_pads and _has_aux_loss(chunk.config)
    return {
        "input_ids": mb.tokens,
        "position_ids": mb.position_ids,
        "attention_mask": None,
        "packed_seq_params": with_slot_layout(mb.packed_seq_params(), mb.slot_layout()),
        "padding_mask": _padding_mask(chunk, mb) if masked else None,
    }


def _has_aux_loss(config: Any) -> bool:
    return bool(config.num_moe_experts) and bool(
        config.moe_aux_loss_coeff or config.moe_z_loss_coeff
    )


def _padding_mask(chunk: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """The micro-batch's MoE padding mask as ``chunk`` takes it: megatron splits it over the
    sequence-parallel ranks only in a chunk that embeds (first stage); a later stage's
    hidden states are already this rank's sequence shard, so the mask must be too."""
    mask = mb.padding_mask()
    if chunk.config.sequence_parallel and not chunk.pre_process:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        mask = mask.chunk(tp, dim=1)[parallel_state.get_tensor_model_parallel_rank()]
    return mask

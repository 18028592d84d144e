"""The micro-batch, from every slot's examples to what a model chunk is called with, for
every consumer (the training step, evaluation, generation), in one place:

1. **pack**: adapter-major single-sequence micro-batches (:class:`MicroBatch`) under a token
   budget, each padded to a multiple of the sequence-parallel size. One packed sequence
   holds whole examples, all of slot 0's, then slot 1's and so on, so each adapter slot owns
   one contiguous span of positions (what the multi-LoRA layers' per-slot token counts
   describe). Attention is causal within an example and never crosses examples, so packing
   does not change what any example sees: the micro-batch carries megatron's
   ``PackedSeqParams`` (``thd`` format, one sequence per example) instead of a ``[S, S]``
   mask, and attention runs per example;
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
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_multilora.data.datasets import Example, Packable, examples_of
from megatron_multilora.layers.lifecycle import ModelOrChunks, model_chunks
from megatron_multilora.layers.slot_layout_route import with_slot_layout
from megatron_multilora.ops.host_values import on_device
from megatron_multilora.ops.slot_layout import SlotLayout
from megatron_multilora.parallel import collective_device

T = TypeVar("T")


@dataclass
class MicroBatch:
    """One packed sequence of ``S`` positions (``S`` a multiple of the pad multiple).

    ``counts[s]`` positions of slot ``s`` follow slot ``s - 1``'s; the ``n_pad`` trailing
    pad positions are counted in the last slot that has positions here (they carry no loss).
    ``ep_slots``: under expert parallelism, the slots with positions in this micro-batch or
    in those the other expert-parallel ranks run alongside it, whose rows can reach this
    rank's experts (set by the training step; None: not known).
    """

    tokens: torch.Tensor  # [1, S] int64 inputs
    labels: torch.Tensor  # [1, S] int64 targets
    loss_mask: torch.Tensor  # [1, S] float32, 1.0 where the label counts
    position_ids: torch.Tensor  # [1, S] int64, restarting at 0 for each example
    counts: list[int]  # positions per adapter slot; len == n_slots, sum == S
    examples_per_slot: list[int]
    seq_lengths: list[int]  # positions per example, then the trailing pads as sequence(s)
    n_pad: int = 0  # trailing positions that hold no example
    ep_slots: tuple[int, ...] | None = None
    values: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # [1, S] float32
    units: list[int] | None = None  # each slot's loss units here (default: its loss tokens)

    def to(self, device: torch.device) -> MicroBatch:
        """This micro-batch with its tensors on ``device`` (itself when already there)."""
        if self.tokens.device == torch.device(device):
            return self
        return dataclasses.replace(
            self,
            tokens=self.tokens.to(device),
            labels=self.labels.to(device),
            loss_mask=self.loss_mask.to(device),
            position_ids=self.position_ids.to(device),
            values={k: v.to(device) for k, v in self.values.items()},
        )

    def packed_seq_params(self) -> PackedSeqParams:
        """The ``thd`` packing description megatron's attention and RoPE take (one sequence
        per example, and one for the trailing pads)."""
        host_ends = list(itertools.accumulate(self.seq_lengths, initial=0))
        ends = on_device(host_ends, torch.int32, self.tokens.device)
        longest = max(self.seq_lengths)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=ends,
            cu_seqlens_kv=ends,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
            cp_group=parallel_state.get_context_parallel_group(check_initialized=False),
        )
        # The bounds as the host knows them, for the CPU attention's buckets (a read of
        # ``cu_seqlens_q`` would wait for the device).
        params.host_cu_seqlens = host_ends
        return params

    def slot_layout(self) -> SlotLayout:
        """Which slot owns which positions (``counts``, ``ep_slots``), for the adapted layers."""
        return SlotLayout(self.counts, self.ep_slots)

    def padding_mask(self) -> torch.Tensor:
        """``[1, S]`` bool, True at the pad positions (megatron's MoE ``padding_mask``, which
        keeps them out of the routers' auxiliary losses)."""
        size = self.tokens.size(1)
        return (torch.arange(size, device=self.tokens.device) >= size - self.n_pad).view(1, size)

    def loss_units_per_slot(self) -> torch.Tensor:
        """``[n_slots]`` int64: what each slot's examples here add to its loss normaliser
        (their ``Example.loss_units``: by default the positions with loss_mask 1)."""
        if self.units is not None:
            return torch.tensor(self.units, dtype=torch.int64)
        spans = torch.split(self.loss_mask.cpu()[0], self.counts)
        return torch.stack([span.sum() for span in spans]).to(torch.int64)

    def sequence_ids(self) -> torch.Tensor:
        """``[S]`` int64: the index of the packed sequence each position belongs to."""
        lengths = on_device(self.seq_lengths, torch.int64, self.tokens.device)
        return torch.repeat_interleave(
            torch.arange(len(self.seq_lengths), device=lengths.device),
            lengths,
            output_size=self.tokens.size(1),
        )


def pad_micro_batch(mb: MicroBatch, length: int, pad_id: int) -> MicroBatch:
    """``mb`` lengthened to ``length`` positions by loss-free pads, as one more sequence (they
    attend only among themselves) counted in the last slot with positions."""
    extra = length - mb.tokens.size(1)
    if extra < 0:
        raise ValueError(f"cannot pad a micro-batch of {mb.tokens.size(1)} positions to {length}")
    if extra == 0:
        return mb
    pads = torch.full((1, extra), pad_id, dtype=mb.tokens.dtype, device=mb.tokens.device)
    counts = list(mb.counts)
    counts[max(i for i, c in enumerate(counts) if c)] += extra
    return dataclasses.replace(
        mb,
        tokens=torch.cat([mb.tokens, pads], 1),
        labels=torch.cat([mb.labels, pads], 1),
        loss_mask=torch.cat([mb.loss_mask, mb.loss_mask.new_zeros(1, extra)], 1),
        values={k: torch.cat([v, v.new_zeros(1, extra)], 1) for k, v in mb.values.items()},
        position_ids=torch.cat(
            [
                mb.position_ids,
                torch.arange(
                    extra, dtype=mb.position_ids.dtype, device=mb.position_ids.device
                ).view(1, extra),
            ],
            1,
        ),
        counts=counts,
        seq_lengths=[*mb.seq_lengths, extra],
        n_pad=mb.n_pad + extra,
    )


def _build(
    items: list[tuple[int, Example]], n_slots: int, pad_multiple: int, pad_id: int
) -> MicroBatch:
    """Pack ``(slot, example)`` pairs, already in adapter-major order, into a MicroBatch."""
    tokens: list[int] = []
    labels: list[int] = []
    loss: list[bool] = []
    positions: list[int] = []
    lengths: list[int] = []
    counts = [0] * n_slots
    units = [0] * n_slots
    examples_per_slot = [0] * n_slots
    names = sorted({k for _, example in items for k in example.values})
    values: dict[str, list[float]] = {k: [] for k in names}
    for slot, example in items:
        n = len(example.tokens) - 1
        tokens += example.tokens[:-1]
        labels += example.tokens[1:] if example.targets is None else example.targets
        loss += example.loss_mask
        for k in names:
            values[k] += example.values.get(k, (0.0,) * n)
        positions += range(n)
        lengths.append(n)
        counts[slot] += n
        units[slot] += example.loss_units
        examples_per_slot[slot] += 1
    n_pad = -len(tokens) % pad_multiple
    tokens += [pad_id] * n_pad
    labels += [pad_id] * n_pad
    loss += [False] * n_pad
    for k in names:
        values[k] += [0.0] * n_pad
    positions += range(n_pad)
    if n_pad:  # the pads form one more sequence: they attend only among themselves
        lengths.append(n_pad)
    counts[items[-1][0]] += n_pad
    size = len(tokens)
    return MicroBatch(
        tokens=torch.tensor(tokens, dtype=torch.int64).view(1, size),
        labels=torch.tensor(labels, dtype=torch.int64).view(1, size),
        loss_mask=torch.tensor(loss, dtype=torch.float32).view(1, size),
        position_ids=torch.tensor(positions, dtype=torch.int64).view(1, size),
        counts=counts,
        examples_per_slot=examples_per_slot,
        seq_lengths=lengths,
        n_pad=n_pad,
        values={k: torch.tensor(v, dtype=torch.float32).view(1, size) for k, v in values.items()},
        units=units,
    )


def pack_micro_batches(
    slot_examples: Sequence[Sequence[Packable]],
    token_budget: int,
    pad_multiple: int = 1,
    pad_id: int = 0,
    slot_order: Sequence[int] | None = None,
) -> list[MicroBatch]:
    """Greedily pack every slot's examples into adapter-major micro-batches.

    ``slot_examples[s]`` are adapter slot ``s``'s examples (possibly none), each an Example
    or a group of them (e.g. a preference pair) that stays in one micro-batch, in order.
    Slots are taken in ``slot_order`` (default: slot order); e.g. ordered by LoRA rank, each
    micro-batch holds slots of similar rank, and the layers compute at the largest rank
    present in it. Within a micro-batch positions are always in slot order. An example of
    ``L`` tokens takes ``L - 1`` positions; a new micro-batch starts when the next example
    (group) would take the current one past ``token_budget`` positions. Each micro-batch is
    then padded to a multiple of ``pad_multiple`` (e.g. the sequence-parallel size), which
    can exceed ``token_budget`` only when the budget is not itself such a multiple.
    Raises ValueError for an example (group) longer than ``token_budget`` positions.
    """
    if token_budget < 1 or pad_multiple < 1:
        raise ValueError(
            f"token_budget and pad_multiple must be >= 1, got {token_budget} and {pad_multiple}"
        )
    n_slots = len(slot_examples)
    order = list(range(n_slots)) if slot_order is None else list(slot_order)
    if sorted(order) != list(range(n_slots)):
        raise ValueError(f"slot_order={order} must be a permutation of the {n_slots} slots")
    batches: list[MicroBatch] = []
    current: list[tuple[int, Example]] = []
    used = 0
    for slot in order:
        for i, item in enumerate(slot_examples[slot]):
            group = examples_of(item)
            n = sum(len(example.tokens) - 1 for example in group)
            if n > token_budget:
                raise ValueError(
                    f"slot {slot} example {i} takes {n} positions, more than token_budget "
                    f"{token_budget}; truncate examples to max_seq_len <= token_budget"
                    f"{' / 2 (a preference pair packs both answers together)' if len(group) > 1 else ''}"
                )
            if used + n > token_budget:
                batches.append(_build(_slot_major(current), n_slots, pad_multiple, pad_id))
                current, used = [], 0
            current += [(slot, example) for example in group]
            used += n
    if current:
        batches.append(_build(_slot_major(current), n_slots, pad_multiple, pad_id))
    return batches


def _slot_major(items: list[tuple[int, Example]]) -> list[tuple[int, Example]]:
    return sorted(items, key=lambda item: item[0])  # stable: each slot keeps its example order


def shard_for_data_parallel(examples: Sequence[T], dp_rank: int, dp_size: int) -> list[T]:
    """Round-robin shard: this data-parallel rank's ``examples[dp_rank::dp_size]``."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
    return list(examples[dp_rank::dp_size])


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

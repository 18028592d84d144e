"""Adapter-major packing of tokenized examples into single-sequence micro-batches.

A micro-batch is one packed sequence (batch size 1) holding whole examples: all of slot 0's,
then slot 1's, and so on, so each adapter slot owns one contiguous span of positions (what
the multi-LoRA layers' per-slot token counts describe). Attention is causal within an
example and never crosses examples, so packing does not change what any example sees: the
micro-batch carries megatron's ``PackedSeqParams`` (``thd`` format, one sequence per example)
instead of a ``[S, S]`` mask, and attention runs per example.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_multilora.data.datasets import Example, Packable, examples_of
from megatron_multilora.ops.host_values import on_device
from megatron_multilora.ops.slot_layout import SlotLayout

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

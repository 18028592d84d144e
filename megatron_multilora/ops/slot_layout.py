"""A packed micro-batch's slot layout: which adapter slot owns which tokens (torch only).

A micro-batch is packed adapter-major: the ``[s, b]`` tokens flattened sequence-major are
slot 0's tokens, then slot 1's, and so on. :class:`SlotLayout` holds the per-slot counts (and,
under expert parallelism, the slots whose rows can reach this rank's experts); a layer whose
input is this rank's sequence-parallel shard sees only a window of those rows, its spans the
per-slot overlap with that window, as :class:`Segments` (row groups for the grouped GEMMs,
each row labelled with its slot). Packing (``data/``) builds the layout, the layers read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from megatron_multilora.ops.grouped_mm import group_offsets, group_sizes


@dataclasses.dataclass(frozen=True)
class Segments:
    """Contiguous row groups of a 2-D activation: group g owns the rows up to ``offsets[g]``.

    ``offsets`` are the int32 cumulative group ends ``torch._grouped_mm`` takes, on the
    compute device; ``label_of_row`` is each row's group label (its adapter slot), for
    per-row scaling and dropout. ``rows`` is the total. ``counts`` are the group sizes on the
    host when known; :meth:`host_counts` reads them back from the device otherwise, which only
    the per-group fallback needs (it syncs on an accelerator; the grouped kernel does not).
    """

    offsets: torch.Tensor
    label_of_row: torch.Tensor
    rows: int
    counts: tuple[int, ...] | None = None

    @classmethod
    def from_counts(
        cls, counts: Sequence[int], device: torch.device, labels: Sequence[int] | None = None
    ) -> Segments:
        """Groups of host-known sizes; ``labels[g]`` (default ``g``) labels group g's rows."""
        counts = tuple(int(c) for c in counts)
        host = torch.tensor(counts, dtype=torch.int64)
        names = (
            torch.arange(len(counts)) if labels is None else torch.tensor(labels, dtype=torch.int64)
        )
        rows = sum(counts)
        return cls(
            offsets=group_offsets(counts, device),
            label_of_row=torch.repeat_interleave(names, host, output_size=rows).to(device),
            rows=rows,
            counts=counts,
        )

    @classmethod
    def from_sorted_keys(
        cls, sorted_keys: torch.Tensor, num_groups: int, label_of_row: torch.Tensor
    ) -> Segments:
        """Groups of rows already sorted by group id ``sorted_keys``, all on the device."""
        ends = torch.searchsorted(
            sorted_keys, torch.arange(num_groups, device=sorted_keys.device), right=True
        )
        return cls(
            offsets=ends.to(torch.int32), label_of_row=label_of_row, rows=int(sorted_keys.numel())
        )

    def host_counts(self) -> tuple[int, ...]:
        return self.counts if self.counts is not None else group_sizes(self.offsets)


def narrow_counts_to_window(counts: Sequence[int], start: int, rows: int) -> list[int]:
    """Intersect contiguous per-slot spans with the row window ``[start, start + rows)``.

    E.g. counts (3, 0, 5) over rows 0..8 and window start=4, rows=4 gives (0, 0, 4).
    """
    out, begin, end = [], 0, start + rows
    for c in counts:
        lo, hi = max(begin, start), min(begin + c, end)
        out.append(max(0, hi - lo))
        begin += c
    return out


class SlotLayout:
    """Token counts per adapter slot of one micro-batch, shared by every wrapped layer.

    ``active`` are the slots with tokens in this micro-batch: layers run their grouped GEMMs
    over those slots only, so an idle slot costs no GEMM work and gets no gradient. Segments
    (one group per active slot, rows labelled with the slot id) are built once per distinct
    (window, device) and reused by all layers: a forward costs one host-to-device copy of the
    counts per window, not one per layer, and no device-to-host sync.

    ``ep_slots`` are the slots whose rows can reach this rank's experts under expert
    parallelism (the active slots of every expert-parallel rank's micro-batch): the expert
    layers' GEMMs run over these. Default: every slot, since other ranks' slots are unknown.
    """

    def __init__(self, counts: Sequence[int], ep_slots: Sequence[int] | None = None) -> None:
        self.counts = tuple(int(c) for c in counts)
        self.total = sum(self.counts)
        self.active = tuple(i for i, c in enumerate(self.counts) if c > 0)
        self.ep_slots = (
            tuple(range(len(self.counts))) if ep_slots is None else tuple(sorted(set(ep_slots)))
        )
        self._cache: dict[tuple[int, int, torch.device], Segments] = {}

    @property
    def n_slots(self) -> int:
        return len(self.counts)

    def segments(self, start: int, rows: int, device: torch.device) -> Segments:
        key = (start, rows, device)
        seg = self._cache.get(key)
        if seg is None:
            counts = (
                self.counts
                if (start, rows) == (0, self.total)
                else narrow_counts_to_window(self.counts, start, rows)
            )
            seg = self._cache[key] = Segments.from_counts(
                [counts[i] for i in self.active], device, labels=self.active
            )
        return seg


class DeviceSlotLayout(SlotLayout):
    """A micro-batch's slot layout held on the device alone: ``offsets`` (``[n_slots]`` int32
    cumulative ends) and ``label_of_row`` (``[rows]``). The host knows neither the counts nor
    which slots have rows, so every slot takes part (an empty group costs the grouped kernel
    nothing) and no layer reads anything back: what a CUDA graph replays, its tensors refilled
    for each micro-batch. One window only, the whole micro-batch (no sequence parallelism)."""

    def __init__(self, offsets: torch.Tensor, label_of_row: torch.Tensor) -> None:
        self.counts = None  # type: ignore[assignment]
        self.total = label_of_row.numel()
        self.active = self.ep_slots = tuple(range(offsets.numel()))
        self._whole = Segments(offsets=offsets, label_of_row=label_of_row, rows=self.total)

    @property
    def n_slots(self) -> int:
        return len(self.active)

    def segments(self, start: int, rows: int, device: torch.device) -> Segments:
        if (start, rows) != (0, self.total) or device != self._whole.offsets.device:
            raise ValueError(
                f"a device slot layout covers the {self.total} rows of its micro-batch on "
                f"{self._whole.offsets.device}; rows {start}..{start + rows} on {device} were "
                "asked for (sequence parallelism needs the host layout)"
            )
        return self._whole


def check_token_counts(tokens_per_adapter: Sequence[int] | torch.Tensor, n_slots: int) -> list[int]:
    """Validate user-given counts (length, integer, non-negative); return them as ints."""
    if isinstance(tokens_per_adapter, torch.Tensor):
        if tokens_per_adapter.dim() != 1 or tokens_per_adapter.is_floating_point():
            raise ValueError(
                "tokens_per_adapter must be a 1-D integer tensor, got "
                f"{tokens_per_adapter.dtype} of shape {tuple(tokens_per_adapter.shape)}"
            )
        counts = tokens_per_adapter.tolist()  # the one host sync the counts need
    else:
        counts = list(tokens_per_adapter)
    if len(counts) != n_slots:
        raise ValueError(
            f"tokens_per_adapter has {len(counts)} entries but the model has "
            f"{n_slots} adapter slots: give one count per slot (0 for unused)"
        )
    bad = [
        (i, c)
        for i, c in enumerate(counts)
        if not isinstance(c, int) or isinstance(c, bool) or c < 0
    ]
    if bad:
        raise ValueError(
            f"tokens_per_adapter must be non-negative integers; bad entries (slot, value): {bad}"
        )
    return counts


def check_ep_slots(ep_slots: Sequence[int] | None, counts: Sequence[int]) -> None:
    """``ep_slots`` must be slot indices and include every slot with tokens here."""
    if ep_slots is None:
        return
    n = len(counts)
    bad = [s for s in ep_slots if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < n]
    if bad:
        raise ValueError(f"ep_slots must be slot indices in 0..{n - 1}; bad entries: {bad}")
    missing = [i for i, c in enumerate(counts) if c > 0 and i not in set(ep_slots)]
    if missing:
        raise ValueError(
            f"ep_slots={list(ep_slots)} leaves out slots {missing}, which have tokens "
            "in this micro-batch: give the union of every expert-parallel rank's "
            "slots with tokens"
        )

"""One GEMM over contiguous row segments, each with its own weight.

``grouped_linear(x, w, seg)`` computes, for every group g, ``x[rows of g] @ w[g].T``.
The matmul itself is :func:`megatron_multilora.ops.grouped_mm.grouped_mm`; this module adds
the slot segments and rebuilding the stacked weights in backward.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch

from megatron_multilora.ops.grouped_mm import group_offsets, group_sizes, grouped_mm


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
    counts: Optional[tuple[int, ...]] = None

    @classmethod
    def from_counts(cls, counts: Sequence[int], device: torch.device,
                    labels: Optional[Sequence[int]] = None) -> "Segments":
        """Groups of host-known sizes; ``labels[g]`` (default ``g``) labels group g's rows."""
        counts = tuple(int(c) for c in counts)
        host = torch.tensor(counts, dtype=torch.int64)
        names = torch.arange(len(counts)) if labels is None else torch.tensor(labels, dtype=torch.int64)
        rows = sum(counts)
        return cls(offsets=group_offsets(counts, device),
                   label_of_row=torch.repeat_interleave(names, host, output_size=rows).to(device),
                   rows=rows, counts=counts)

    @classmethod
    def from_sorted_keys(cls, sorted_keys: torch.Tensor, num_groups: int,
                         label_of_row: torch.Tensor) -> "Segments":
        """Groups of rows already sorted by group id ``sorted_keys``, all on the device."""
        ends = torch.searchsorted(sorted_keys, torch.arange(num_groups, device=sorted_keys.device),
                                  right=True)
        return cls(offsets=ends.to(torch.int32), label_of_row=label_of_row,
                   rows=int(sorted_keys.numel()))

    def host_counts(self) -> tuple[int, ...]:
        return self.counts if self.counts is not None else group_sizes(self.offsets)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, seg: Segments,
                   rebuild_w: Optional[Callable[[], torch.Tensor]] = None) -> torch.Tensor:
    """``[rows, in] x [G, out, in] -> [rows, out]``, group g's rows times ``w[g].T``.

    ``rebuild_w`` recomputes ``w`` (e.g. a stack of per-slot weights): backward then rebuilds
    it instead of autograd keeping ``w`` alive from forward to backward, so a stacked copy of
    the weights costs memory only while it is used.
    """
    if x.size(0) != seg.rows:
        raise ValueError(f"grouped_linear: {x.size(0)} rows but segments cover {seg.rows}")
    w = w.to(x.dtype)
    if rebuild_w is None:
        return grouped_mm(x, w, seg.offsets, seg.counts)
    with torch.autograd.graph.saved_tensors_hooks(*_rebuilt_in_backward(w, rebuild_w)):
        return grouped_mm(x, w, seg.offsets, seg.counts)


def _rebuilt_in_backward(w: torch.Tensor, rebuild: Callable[[], torch.Tensor]):
    """Saved-tensor hooks that save views of ``w`` as (size, stride, offset) only. They hold
    no reference to ``w`` itself, which is what lets it be freed after forward."""
    storage, dtype = w.untyped_storage().data_ptr(), w.dtype

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() == storage and t.dtype == dtype:
            return (t.size(), t.stride(), t.storage_offset())
        return t

    def unpack(saved):
        if isinstance(saved, tuple):
            with torch.no_grad():
                return rebuild().to(dtype).as_strided(*saved)
        return saved

    return pack, unpack

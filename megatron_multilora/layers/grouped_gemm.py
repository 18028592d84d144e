"""One GEMM over contiguous row segments, each with its own weight.

``grouped_linear(x, w, seg)`` computes, for every group g, ``x[rows of g] @ w[g].T``.
The matmul itself is :func:`megatron_multilora.ops.grouped_mm.grouped_mm`; this module adds
the slot segments (:class:`~megatron_multilora.ops.slot_layout.Segments`) and rebuilding
the stacked weights in backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_multilora.ops.grouped_mm import grouped_mm
from megatron_multilora.ops.slot_layout import Segments


def grouped_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    seg: Segments,
    rebuild_w: Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[rows, in] x [G, out, in] -> [rows, out]``, group g's rows times ``w[g].T``.

    ``rebuild_w`` recomputes ``w`` (e.g. a stack of per-slot weights): backward then rebuilds
    it instead of autograd keeping ``w`` alive from forward to backward, so a stacked copy of
    the weights costs memory only while it is used.
    """
    if x.size(0) != seg.rows:
        raise ValueError(f"grouped_linear: {x.size(0)} rows but segments cover {seg.rows}")
    if w.dtype != x.dtype:
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

"""One GEMM over contiguous row segments, each with its own weight.

``grouped_linear(x, w, seg)`` computes, for every group g, ``x[rows of g] @ w[g].T``.
It runs as one ``torch._grouped_mm`` call where dtype, alignment and device allow it, and as
an exact per-group loop of ``torch.mm`` elsewhere (the two were bit-identical on CPU).
"""

from __future__ import annotations

import dataclasses

import torch

_GROUPED_MM = getattr(torch, "_grouped_mm", None)


@dataclasses.dataclass(frozen=True)
class Segments:
    """Contiguous row groups of a 2-D activation: group g owns ``counts[g]`` rows, in order.

    ``offsets`` are the int32 cumulative group ends ``torch._grouped_mm`` takes;
    ``group_of_row`` maps each row to its group (for per-row scaling).
    """

    counts: tuple[int, ...]
    offsets: torch.Tensor
    group_of_row: torch.Tensor

    @classmethod
    def from_counts(cls, counts: list[int] | tuple[int, ...], device: torch.device) -> "Segments":
        counts = tuple(int(c) for c in counts)
        host = torch.tensor(counts, dtype=torch.int64)
        group_of_row = torch.repeat_interleave(torch.arange(len(counts)), host)
        return cls(
            counts=counts,
            offsets=host.cumsum(0).to(dtype=torch.int32, device=device),
            group_of_row=group_of_row.to(device),
        )

    @property
    def rows(self) -> int:
        return sum(self.counts)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    ``_grouped_mm``'s backward rejects stride-0 gradients such as those of ``y.sum()``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.contiguous()


def _grouped_mm_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    if _GROUPED_MM is None or x.dtype != w.dtype or not x.is_contiguous():
        return False
    if x.is_cuda:
        # The CUDA kernel is bf16-only and needs Hopper or newer.
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9:
            return False
    elif x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    # Every stride must be a multiple of 16 bytes.
    per16 = 16 // x.element_size()
    return x.size(1) % per16 == 0 and w.size(1) % per16 == 0


def grouped_linear(x: torch.Tensor, w: torch.Tensor, seg: Segments) -> torch.Tensor:
    """``[rows, in] x [G, out, in] -> [rows, out]``, group g's rows times ``w[g].T``."""
    if x.size(0) != seg.rows:
        raise ValueError(f"grouped_linear: {x.size(0)} rows but segments cover {seg.rows}")
    w = w.to(x.dtype)
    if _grouped_mm_usable(x, w):
        return _ContiguousGrad.apply(_GROUPED_MM(x, w.transpose(1, 2), offs=seg.offsets))
    parts = torch.split(x, seg.counts)
    return torch.cat([p @ w[g].t() for g, p in enumerate(parts)], dim=0)

"""One GEMM over contiguous row groups, each with its own weight (no LoRA knowledge).

``grouped_mm(x, w, offsets)`` computes, for every group g, ``x[rows of g] @ w[g].T``. It
runs as one ``torch._grouped_mm`` call where dtype, alignment and device allow it, and as an
exact per-group loop of ``torch.mm`` elsewhere (the two were bit-identical on CPU). Used by
the frozen base's expert linears and by the multi-LoRA layers.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

_GROUPED_MM = getattr(torch, "_grouped_mm", None)


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


def group_offsets(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """Cumulative group ends of host-known group sizes, as ``torch._grouped_mm`` takes them."""
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(dtype=torch.int32, device=device)


def group_sizes(offsets: torch.Tensor) -> tuple[int, ...]:
    """Group sizes from cumulative group ends (reads them back from the device)."""
    ends = [0] + offsets.tolist()
    return tuple(b - a for a, b in zip(ends, ends[1:]))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
               counts: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``[rows, in] x [G, out, in] -> [rows, out]`` (same dtype): group g's rows times
    ``w[g].T``. ``offsets`` are the int32 cumulative group ends on the compute device (what
    ``torch._grouped_mm`` takes); ``counts`` the group sizes on the host when known: only the
    per-group fallback needs them, and reading them from ``offsets`` syncs on an accelerator.
    """
    if _grouped_mm_usable(x, w):
        y = _GROUPED_MM(x, w.transpose(1, 2), offs=offsets)
        if y.requires_grad:
            # _grouped_mm's backward rejects stride-0 gradients such as those of y.sum(). A
            # hook rather than an identity Function keeps y its own tensor (not a view), so a
            # caller may still add into it in place.
            y.register_hook(torch.Tensor.contiguous)
        return y
    parts = torch.split(x, list(counts) if counts is not None else group_sizes(offsets))
    return torch.cat([p @ w[g].t() for g, p in enumerate(parts)], dim=0)

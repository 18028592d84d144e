"""One GEMM over contiguous row groups, each with its own weight (no LoRA knowledge).

``grouped_mm(x, w, offsets)`` computes, for every group g, ``x[rows of g] @ w[g].T``. It
runs as one ``torch._grouped_mm`` call where torch, dtype, device and shapes allow it, and
as an exact per-group loop of ``torch.mm`` elsewhere (the two were bit-identical on CPU).
Used by the frozen base's expert linears and by the multi-LoRA layers.

On CPU, where ``torch._grouped_mm`` is a loop of MKL GEMMs, the backward is our own: a
gradient with a narrow last dim (2-15 columns: a LoRA rank, i.e. B's input and weight
gradients) is computed as the transpose of its wide transpose, one ``torch._grouped_mm``
call each. MKL runs the narrow orientation several times slower (figures:
benchmarks/README.md, "Figures behind choices in the code").

The kernel reads every matrix with its rows 16-byte aligned: each stride but the last (1)
a multiple of 16 bytes and, on CUDA, the data pointer too; it raises otherwise. Shapes decide
whether that can hold (``in`` and ``out`` multiples of 16 bytes); a view that breaks it
anyway (e.g. a factor cut to a lower rank out of a buffer whose max rank is not a multiple
of 8) is copied first, which costs a weight-sized copy, not a fallback to the loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from megatron_multilora.ops.host_values import on_device

_GROUPED_MM = getattr(torch, "_grouped_mm", None)  # absent in older torch (2.6)


def kernel_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can run ``x [rows, in] x w [G, out, in]``: it exists,
    dtypes match, the device runs it (CUDA: bf16 on Hopper or newer) and ``in`` and ``out``
    are multiples of 16 bytes (the row strides of x, w, y and their gradients)."""
    if _GROUPED_MM is None or x.dtype != w.dtype or x.dim() != 2 or w.dim() != 3:
        return False
    if x.is_cuda:
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9:
            return False
    elif x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    per16 = 16 // x.element_size()
    return x.size(1) % per16 == 0 and w.size(1) % per16 == 0


def rows_aligned(t: torch.Tensor) -> bool:
    """``t``'s rows are laid out as the kernel reads them (see the module docstring)."""
    per16 = 16 // t.element_size()
    strides = t.stride()
    return (
        strides[-1] == 1
        and strides[-2] >= max(1, t.size(-1))
        and all(s % per16 == 0 for s in strides[:-1])
        and (not t.is_cuda or t.data_ptr() % 16 == 0)
    )


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a fresh contiguous (so aligned) copy where its layout would make the kernel
    raise; differentiable either way."""
    return t if rows_aligned(t) else t.clone(memory_format=torch.contiguous_format)


def group_offsets(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """Cumulative group ends of host-known group sizes, as ``torch._grouped_mm`` takes them."""
    return on_device(list(itertools.accumulate(counts)), torch.int32, device)


def group_sizes(offsets: torch.Tensor) -> tuple[int, ...]:
    """Group sizes from cumulative group ends (reads them back from the device)."""
    ends = [0] + offsets.tolist()
    return tuple(b - a for a, b in itertools.pairwise(ends))


def grouped_mm(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, counts: Sequence[int] | None = None
) -> torch.Tensor:
    """``[rows, in] x [G, out, in] -> [rows, out]`` (same dtype): group g's rows times
    ``w[g].T``. ``offsets`` are the int32 cumulative group ends on the compute device (what
    ``torch._grouped_mm`` takes); ``counts`` the group sizes on the host when known: only the
    per-group fallback needs them, and reading them from ``offsets`` syncs on an accelerator.
    """
    if kernel_takes(x, w):
        narrow = _transposed_backward(x, w)
        return _GroupedMM.apply(kernel_layout(x), kernel_layout(w), offsets, narrow)
    parts = torch.split(x, list(counts) if counts is not None else group_sizes(offsets))
    return torch.cat([p @ w[g].t() for g, p in enumerate(parts)], dim=0)


def single_group_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_mm` of one group, ``x [rows, in] @ w[out, in].T``, with the GEMMs
    that group has in a call with other groups: the same BLAS calls (transposes, shapes,
    the operands' leading dims), so the same bits, forward and both gradients, which is what
    mixed == alone rests on once later GEMMs round them to bf16. For a narrow ``in`` on CPU
    that is the same kernel call with ``x`` as its one group; a plain ``torch.mm`` would
    write a one-row input gradient ``[in, 1]`` column-major, a different BLAS call, which
    MKL's AVX-512 path rounds differently. Elsewhere it is ``x @ w.T``, whose GEMMs are the
    grouped call's per-group ones (``tests/unit/test_grouped_mm.py`` checks both)."""
    if kernel_takes(x, w.unsqueeze(0)) and _transposed_backward(x, w.unsqueeze(0)):
        offsets = torch.tensor([x.size(0)], dtype=torch.int32)  # on CPU, as x
        return _GroupedMM.apply(kernel_layout(x), kernel_layout(w.unsqueeze(0)), offsets, True)
    return x @ w.t()


def _transposed_backward(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel's product ``x [rows, in] x w [G, out, in]`` takes its gradients as
    transposes: on CPU, where ``in`` has 2-15 columns, which MKL runs several times slower in
    the narrow orientation (module doc)."""
    return not x.is_cuda and 1 < w.size(2) < 16


class _GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm(x, w.T)`` whose backward runs the kernel calls of torch's own
    formula (the same operands and layouts, so the same bits) without its transposes and
    views around them: a few ops per product instead of a dozen. With ``narrow`` (a narrow
    ``in`` on CPU) both gradients are transposes of wide products instead (see the module
    docstring)."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, narrow: bool
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w, offsets)
        ctx.narrow = narrow
        return _GROUPED_MM(x, w.transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, offsets = ctx.saved_tensors
        # The kernels read the gradient with its rows aligned, which an expanded (stride-0,
        # e.g. from y.sum()) or offset gradient breaks.
        grad = kernel_layout(grad)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0] and ctx.narrow:
            grad_x = _GROUPED_MM(w.transpose(1, 2), grad.t(), offs=offsets).t().contiguous()
        elif ctx.needs_input_grad[0]:
            grad_x = _GROUPED_MM(grad, w, offs=offsets)
        if ctx.needs_input_grad[1] and ctx.narrow:
            grad_w = _GROUPED_MM(x.t(), grad, offs=offsets).transpose(1, 2)
        elif ctx.needs_input_grad[1]:
            grad_w = _GROUPED_MM(grad.t(), x, offs=offsets)
        return grad_x, grad_w, None, None

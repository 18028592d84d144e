"""Frozen linears whose GEMMs run on weights packed once for oneDNN (CPU, fp32 or bf16).

megatron runs a frozen weight as ``input @ weight.t()`` forward and ``grad @ weight``
backward (``LinearWithFrozenWeight``); on CPU MKL re-packs the weight into its blocked layout
on every call of the forward, a pass over a weight that is cold in cache by the time its
layer comes round. At the few hundred rows of a fine-tuning micro-batch, or the few dozen of
a decode step, that pass is a large share of the GEMM. The base is frozen, so here each
weight is packed once for the forward (one extra copy of the base) and repacked only when it
changes (its version counter or storage moves). The input gradient ``grad @ weight`` runs on
an Intel CPU as MKL on the weight itself, elsewhere on a second pack, of ``weight.t()`` (a
second copy of the base): which wins was measured on both kinds of CPU (the figures of this
module: benchmarks/README.md, "Figures behind choices in the code"). Timing the two ways per
weight at start-up picked at random: a single GEMM of a hot weight is not the cold one of a
step. A weight whose packs would leave less than a quarter of the machine's memory free stays
unpacked (a model too large to double on this machine trains as before, on megatron's path).

:func:`use_packed_frozen_weights` installs this on every megatron parallel linear of a model;
a call it does not cover (a trainable or non-fp32 weight, CUDA, a torch without oneDNN) runs
megatron's own implementation.

With ``gemm_dtype=torch.bfloat16`` (for CPUs that multiply bf16 in hardware) the fp32
model's frozen GEMMs run in bf16 instead: the weight is packed once as bf16 for the forward
and once transposed for the input gradient (two half-size copies, the memory of one fp32
pack), inputs and gradients are rounded to bf16 on the way in and the results come back as
fp32, like ``torch.autocast``'s linears; everything else (adapters, norms, attention, the
optimizer) stays fp32; with AMX or AVX-512 BF16 these GEMMs run much faster than fp32
ones, casts included. The output layer stays fp32: its outputs are the logits, read by
the loss and the evaluation tables with no later layer to absorb the rounding of its
operands.

The bf16 GEMMs run in calls of exactly :data:`ROW_BLOCK` rows (the last block zero-padded):
oneDNN picks its blocking, and with it the order of each row's sums, by the number of rows
(its AMX kernel at 2, 7, 16, 32, 64, 68, 128 and 180 rows of SmolLM2's widths), and a
last-bit difference of the fp32 sum becomes a whole bf16 step once rounded. In fixed-shape
calls a row's result is a function of the row and the weight alone, whatever runs beside
it, on every CPU (the one kernel property kept, that a call treats each of its rows alike,
is tested at every offset of a block by ``tests/unit/test_packed_linear.py``). The fp32
GEMMs run whole: their kernels' choices by row count (MKL's at 1, 2 and 7 rows, on an Intel
CPU also at 64 to 180; oneDNN's pack at 1 row there) move a row's result in its last fp32
bits, within the tolerances mixed == alone is stated with, and blocking them cost the main
job's step 1.18x to 1.58x on a 2-core AMD EPYC (benchmarks/README.md).
"""

from __future__ import annotations

import types
from typing import Any, NamedTuple

import psutil
import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.utils import get_tensor_model_parallel_group_if_none


def _onednn_linear(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, None, "none", [], "")


ROW_BLOCK = 64
"""Rows of every bf16 frozen GEMM call (see the module docstring): four of AMX's 16-row
tiles, the block measured to keep every row's bits on an AMX Xeon at SmolLM2's widths."""


def _gemm(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``rows`` times a packed weight on oneDNN: fp32 whole, bf16 in calls of exactly
    :data:`ROW_BLOCK` rows, the last block padded with zero rows (the caller's cast back to
    fp32 makes a fresh tensor of the sliced result)."""
    n = rows.size(0)
    if packed.dtype == torch.float32 or n == 0:
        return _onednn_linear(rows, packed)
    full = n - n % ROW_BLOCK
    outs = [_onednn_linear(rows[i : i + ROW_BLOCK], packed) for i in range(0, full, ROW_BLOCK)]
    if full < n:
        tail = rows.new_zeros(ROW_BLOCK, rows.size(1))
        tail[: n - full] = rows[full:]
        outs.append(_onednn_linear(tail, packed)[: n - full])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


_FREE_FRACTION = 0.25
"""Memory left free after packing a weight, as a fraction of the machine's."""


def bf16_gemms_supported() -> bool:
    """Whether oneDNN runs bf16 GEMMs on this CPU (AVX-512 BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bf16_gemms_fast() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX tiles, or AVX-512 BF16's
    dot products): there bf16 GEMMs run much faster than fp32 ones at a micro-batch's rows
    (see the module's note). oneDNN also runs bf16 on plain AVX-512, emulated: not fast."""
    return bf16_gemms_supported() and (
        torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    )


class _Packs(NamedTuple):
    forward: torch.Tensor
    """``weight`` in oneDNN's layout for ``input @ weight.t()``, in the GEMMs' dtype."""
    input_grad: torch.Tensor | None
    """``weight.t()`` likewise, for ``grad @ weight`` (bf16, or fp32 off Intel CPUs); None:
    that GEMM runs on the fp32 weight itself."""


def _mkl_is_tuned_here() -> bool:
    """Whether this CPU is an Intel one, where MKL runs its own tuned GEMM kernels (read from
    /proc/cpuinfo; elsewhere assumed, as before this choice existed)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return "GenuineIntel" in line
    except OSError:
        pass
    return True


_INPUT_GRAD_PACKED = not _mkl_is_tuned_here()
"""Whether fp32 input gradients run on a pack of ``weight.t()`` (see the module docstring)."""


def _pack(weight: torch.Tensor, dtype: torch.dtype) -> _Packs | None:
    """``weight``'s packs for GEMMs in ``dtype``, made on first use and after any change;
    None where there is no room for them."""
    key = (weight._version, weight.data_ptr())
    by_dtype = weight.__dict__.setdefault("_onednn_packs", {})
    cached = by_dtype.get(dtype)
    if cached is None or cached[0] != key:
        memory = psutil.virtual_memory()
        packs = None
        both = dtype != torch.float32 or _INPUT_GRAD_PACKED
        needed = weight.numel() * dtype.itemsize * (2 if both else 1)  # the packs' bytes
        if memory.available - needed >= _FREE_FRACTION * memory.total:
            reorder = torch.ops.mkldnn._reorder_linear_weight
            with torch.no_grad():
                low = weight.detach().to(dtype)
                packs = _Packs(reorder(low), reorder(low.t().contiguous()) if both else None)
        cached = by_dtype[dtype] = (key, packs)
    return cached[1]


def packable(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this call can run on a packed weight (room for it permitting): a frozen fp32
    weight and input on CPU, with torch built with oneDNN."""
    return (
        not weight.requires_grad
        and weight.device.type == "cpu"
        and weight.dtype == input.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
    )


class _PackedFrozenLinear(torch.autograd.Function):
    """``LinearWithFrozenWeight`` (same forward, same input gradient and its TP all-reduce)
    with the forward on the weight's pack, for 2-D input (the op returns N-D results as
    views, which autograd does not allow as a custom Function's output)."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        packs: _Packs,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        allreduce_dgrad: bool,
        tp_group: torch.distributed.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.packs, ctx.allreduce_dgrad, ctx.tp_group = packs, allreduce_dgrad, tp_group
        output = _gemm(input.to(packs.forward.dtype), packs.forward).to(input.dtype)
        return output if bias is None else output + bias

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        if not ctx.needs_input_grad[0]:  # e.g. the first layer's input, the frozen embedding's
            return None, None, None, None, None, None
        (weight,) = ctx.saved_tensors
        pack = ctx.packs.input_grad
        grad_input = (
            grad_output.matmul(weight)
            if pack is None
            else _gemm(grad_output.to(pack.dtype), pack).to(grad_output.dtype)
        )
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None, None


def _forward_impl(
    self: torch.nn.Module,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    tp_group: torch.distributed.ProcessGroup | None,
    **rest: Any,
) -> torch.Tensor:
    packs = (
        _pack(weight, self._frozen_gemm_dtype)
        if packable(input, weight) and all(v is None for v in rest.values())
        else None
    )
    if packs is None:
        return type(self)._forward_impl(
            self,
            input,
            weight,
            bias,
            gradient_accumulation_fusion=gradient_accumulation_fusion,
            allreduce_dgrad=allreduce_dgrad,
            sequence_parallel=sequence_parallel,
            tp_group=tp_group,
            **rest,
        )
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    if sequence_parallel:  # as megatron's linear_with_frozen_weight
        input = gather_from_sequence_parallel_region(
            input, tensor_parallel_output_grad=True, group=tp_group
        )
    rows = input.reshape(-1, input.size(-1))
    output = _PackedFrozenLinear.apply(rows, packs, weight, bias, allreduce_dgrad, tp_group)
    return output.view(*input.shape[:-1], output.size(-1))


def use_packed_frozen_weights(
    model: torch.nn.Module, gemm_dtype: torch.dtype = torch.float32
) -> int:
    """Run every megatron Column/RowParallelLinear of ``model`` (TE's excepted: they are
    subclasses of neither) on packed weights where :func:`packable`, their GEMMs in
    ``gemm_dtype`` (fp32 or bf16; the output layer's in fp32); the number installed."""
    if gemm_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"frozen GEMMs run in float32 or bfloat16, not {gemm_dtype}")
    installed = 0
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module._forward_impl = types.MethodType(_forward_impl, module)
            module._frozen_gemm_dtype = (
                torch.float32 if name.split(".")[-1] == "output_layer" else gemm_dtype
            )
            installed += 1
    return installed

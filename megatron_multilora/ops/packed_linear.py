"""Frozen linears on weights packed once for oneDNN (CPU, fp32).

megatron runs a frozen weight as ``input @ weight.t()`` forward and ``grad @ weight``
backward (``LinearWithFrozenWeight``); on CPU MKL re-packs the weight into its blocked layout
on every call, a pass over a weight that is cold in cache by the time its layer comes round.
At the few hundred rows of a fine-tuning micro-batch, or the few dozen of a decode step, that
pass is a large share of the GEMM (2-core AMD EPYC, one thread, SmolLM2's 30 layers of
linears: 50 GFLOP/s by MKL vs 71 packed at 68 rows, 69 vs 78 at 180). The base is frozen, so here each weight is packed once per
direction (``weight`` for the forward, ``weight.t()`` for the input gradient, two extra copies
of the base) and repacked only when it changes (its version counter or storage moves). A
weight whose packs would leave less than a quarter of the machine's memory free stays
unpacked (a model too large to triple on this machine trains as before, on megatron's path).

:func:`use_packed_frozen_weights` installs this on every megatron parallel linear of a model;
a call it does not cover (a trainable or non-fp32 weight, CUDA, a torch without oneDNN) runs
megatron's own implementation.
"""

from __future__ import annotations

import types
from typing import Any, Optional

import psutil
import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.utils import get_tensor_model_parallel_group_if_none


def _onednn_linear(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, None, "none", [], "")


_FREE_FRACTION = 0.25
"""Memory left free after packing a weight, as a fraction of the machine's."""


def _packs(weight: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``weight``'s (forward, input-gradient) packs, made on first use and after any change;
    None where there is no room for them."""
    key = (weight._version, weight.data_ptr())
    cached = getattr(weight, "_onednn_packs", None)
    if cached is None or cached[0] != key:
        memory = psutil.virtual_memory()
        room = memory.available - 2 * weight.nbytes >= _FREE_FRACTION * memory.total
        packs = None
        if room:
            with torch.no_grad():
                reorder = torch.ops.mkldnn._reorder_linear_weight
                packs = reorder(weight.detach()), reorder(weight.detach().t().contiguous())
        cached = weight._onednn_packs = (key, packs)
    return cached[1]


def packable(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this call can run on packed weights (room for them permitting): a frozen fp32
    weight and input on CPU, with torch built with oneDNN."""
    return (not weight.requires_grad and weight.device.type == "cpu"
            and weight.dtype == input.dtype == torch.float32 and weight.dim() == 2
            and torch.backends.mkldnn.is_available())


class _PackedFrozenLinear(torch.autograd.Function):
    """``LinearWithFrozenWeight`` (same forward, same input gradient and its TP all-reduce)
    on the weight's packs, for 2-D input (the op returns N-D results as views, which autograd
    does not allow as a custom Function's output)."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, packs: tuple[torch.Tensor, torch.Tensor],
                bias: Optional[torch.Tensor], allreduce_dgrad: bool,
                tp_group: Optional[torch.distributed.ProcessGroup]) -> torch.Tensor:
        forward_pack, ctx.backward_pack = packs
        ctx.allreduce_dgrad, ctx.tp_group = allreduce_dgrad, tp_group
        output = _onednn_linear(input, forward_pack)
        return output if bias is None else output + bias

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        if not ctx.needs_input_grad[0]:  # e.g. the first layer's input, the frozen embedding's
            return None, None, None, None, None
        grad_input = _onednn_linear(grad_output, ctx.backward_pack)
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None


def _forward_impl(self: torch.nn.Module, input: torch.Tensor, weight: torch.Tensor,
                  bias: Optional[torch.Tensor], gradient_accumulation_fusion: bool,
                  allreduce_dgrad: bool, sequence_parallel: bool,
                  tp_group: Optional[torch.distributed.ProcessGroup],
                  **rest: Any) -> torch.Tensor:
    packs = (_packs(weight) if packable(input, weight)
             and all(v is None for v in rest.values()) else None)
    if packs is None:
        return type(self)._forward_impl(
            self, input, weight, bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
            allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
            tp_group=tp_group, **rest)
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    if sequence_parallel:  # as megatron's linear_with_frozen_weight
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True,
                                                     group=tp_group)
    rows = input.reshape(-1, input.size(-1))
    output = _PackedFrozenLinear.apply(rows, packs, bias, allreduce_dgrad, tp_group)
    return output.view(*input.shape[:-1], output.size(-1))


def use_packed_frozen_weights(model: torch.nn.Module) -> int:
    """Run every megatron Column/RowParallelLinear of ``model`` (TE's excepted: they are
    subclasses of neither) on packed weights where :func:`packable`; the number installed."""
    installed = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module._forward_impl = types.MethodType(_forward_impl, module)
            installed += 1
    return installed

"""A micro-batch's slot layout travels with the micro-batch, in its ``PackedSeqParams``.

Under a pipeline schedule micro-batch k's backward runs after later micro-batches were
forwarded. Backward itself uses what autograd saved, but activation recompute re-runs
forwards during backward, and a layout stored once per model would by then be a later
micro-batch's. So the layout (:class:`SlotLayout`) rides in the ``packed_seq_params`` megatron
hands to every transformer layer, and hooks on each layer that holds multi-LoRA linears
hand it to them (and so to the layer's MoE slot routing):

* a forward pre-hook reads the call's ``packed_seq_params``: this covers the plain forward
  and the full-recompute re-run, to which megatron passes the same params object
  (``TransformerBlock._checkpointed_forward`` closes over it);
* under selective recompute, a forward hook registers a gradient hook on the layer's output
  hidden states, which runs before any of the layer's backward: selective ``mlp``/``moe``/``shared_experts`` recompute
  re-runs those modules (``tensor_parallel.checkpoint``) inside the layer's backward, without
  the params, and must see its own micro-batch's layout again.

Multi-LoRA linears outside any transformer layer (e.g. an adapted ``output_layer``) are
handed the layout by a pre-hook on the model chunk itself; nothing there is recomputed.
Calls whose params carry no layout leave the linears as ``set_tokens_per_adapter_slot`` set
them.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional, Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_multilora.layers.multi_lora_linear import MultiLoRALinear
from megatron_multilora.ops.slot_layout import SlotLayout, check_ep_slots, check_token_counts


@dataclasses.dataclass
class SlotPackedSeqParams(PackedSeqParams):
    """megatron's ``PackedSeqParams`` plus the micro-batch's per-slot token layout. megatron
    passes the object through unchanged (and ``dataclasses.replace`` keeps the subclass)."""

    slot_layout: Optional[SlotLayout] = None


def with_slot_layout(params: PackedSeqParams, tokens_per_adapter: Sequence[int],
                     ep_slots: Optional[Sequence[int]] = None) -> SlotPackedSeqParams:
    """``params`` carrying the layout ``set_tokens_per_adapter_slot`` would set: slot i owns
    the next ``tokens_per_adapter[i]`` tokens; ``ep_slots`` as there. The number of slots is
    checked against the model's in the layers' hooks."""
    counts = check_token_counts(list(tokens_per_adapter), len(tokens_per_adapter))
    check_ep_slots(ep_slots, counts)
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(PackedSeqParams)}
    return SlotPackedSeqParams(**fields, slot_layout=SlotLayout(counts, ep_slots))


def _hand(linears: list[MultiLoRALinear], tokens: SlotLayout) -> None:
    if len(tokens.counts) != linears[0].n_adapters:
        check_token_counts(list(tokens.counts), linears[0].n_adapters)  # raises, naming both
    for linear in linears:
        linear.slot_layout = tokens


def _carried(params: Any) -> Optional[SlotLayout]:
    return getattr(params, "slot_layout", None)


def _layer_hooks(linears: list[MultiLoRALinear]):
    def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        tokens = _carried(kwargs.get("packed_seq_params"))
        if tokens is not None:
            _hand(linears, tokens)

    def post_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        tokens = _carried(kwargs.get("packed_seq_params"))
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        if tokens is not None and isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda grad: _hand(linears, tokens))

    return pre_hook, post_hook


def _chunk_pre_hook(linears: list[MultiLoRALinear], signature: inspect.Signature):
    def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        params = kwargs.get("packed_seq_params")
        if params is None and args:
            params = signature.bind_partial(*args, **kwargs).arguments.get("packed_seq_params")
        tokens = _carried(params)
        if tokens is not None:
            _hand(linears, tokens)

    return pre_hook


def install_micro_batch_layout_hooks(model: torch.nn.Module | Sequence[torch.nn.Module]) -> None:
    """Hook every transformer layer holding multi-LoRA linears (and each chunk holding some
    outside its layers) to take the layout from the call's ``packed_seq_params``.

    Calling it again replaces the hooks, so linears wrapped since are included."""
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        in_layers: set[int] = set()
        for layer in chunk.modules():
            if isinstance(layer, TransformerLayer):
                linears = [m for m in layer.modules() if isinstance(m, MultiLoRALinear)]
                in_layers.update(id(m) for m in linears)
                handles = []
                if linears:
                    pre_hook, post_hook = _layer_hooks(linears)
                    handles.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True))
                    # Only selective recompute re-runs part of the layer without the params;
                    # otherwise the output's gradient hook would be work for nothing.
                    if layer.config.recompute_granularity == "selective":
                        handles.append(layer.register_forward_hook(post_hook, with_kwargs=True))
                _replace_hooks(layer, handles)
        outside = [m for m in chunk.modules()
                   if isinstance(m, MultiLoRALinear) and id(m) not in in_layers]
        _replace_hooks(chunk, (chunk.register_forward_pre_hook(
            _chunk_pre_hook(outside, inspect.signature(chunk.forward)), with_kwargs=True),)
            if outside else ())


def _replace_hooks(module: torch.nn.Module, handles: Sequence[Any]) -> None:
    for handle in getattr(module, "_slot_layout_handles", ()):
        handle.remove()
    module._slot_layout_handles = tuple(handles)

"""A micro-batch's slot layout travels with the micro-batch: the route from the micro-batch to
every adapted linear.

::

    micro-batch (training/step/micro_batches.py: counts, ep_slots -> SlotLayout)
      -> a carrier megatron hands to every transformer layer of the call:
           SlotPackedSeqParams (packed training/evaluation forwards), or
           SlotInferenceContext (cached generation: [b, s] tokens, a KV cache)
      -> the layer's forward pre-hook hands the SlotLayout to its multi-LoRA linears
      -> the linears' grouped GEMMs, and the MoE layer's slot routing (slot_routing.py),
         which reads it from the expert linears in its own pre-hook
      -> recompute re-runs: full recompute calls the layer again with the same carrier;
         selective recompute re-runs modules inside the layer's backward without it, so a
         gradient hook on the layer's output hands the layout over again first.

Why it travels: under a pipeline schedule micro-batch k's backward runs after later
micro-batches were forwarded, and activation recompute re-runs forwards during backward; a
layout stored once per model would by then be a later micro-batch's. Multi-LoRA linears
outside any transformer layer (e.g. an adapted ``output_layer``) get the layout from a
pre-hook on the model chunk itself; nothing there is recomputed. A call that carries no
layout leaves the linears as ``set_tokens_per_adapter_slot`` (the seed's API for users of the
layers alone) set them.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_multilora.layers.lifecycle import ModelOrChunks, model_chunks
from megatron_multilora.layers.multi_lora_linear import MultiLoRALinear
from megatron_multilora.ops.slot_layout import SlotLayout, check_ep_slots, check_token_counts


@dataclasses.dataclass
class SlotPackedSeqParams(PackedSeqParams):
    """megatron's ``PackedSeqParams`` plus the micro-batch's slot layout. megatron passes the
    object through unchanged (and ``dataclasses.replace`` keeps the subclass)."""

    slot_layout: SlotLayout | None = None


class SlotInferenceContext(StaticInferenceContext):
    """megatron's static KV-cache context plus the slot layout of the next forward (set
    before each one: prefill and decode steps lay slots out differently)."""

    slot_layout: SlotLayout | None = None

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows of every layer's KV cache, in this order. Rows left out
        (finished sequences) are never read again: dropped, not moved as megatron's
        ``swap_key_value_dict`` moves every row, so the copy shrinks with the batch."""
        for layer, (key, value) in self.key_value_memory_dict.items():
            self.key_value_memory_dict[layer] = (key[:, rows], value[:, rows])


def with_slot_layout(
    params: PackedSeqParams,
    layout: SlotLayout | Sequence[int],
    ep_slots: Sequence[int] | None = None,
) -> SlotPackedSeqParams:
    """``params`` carrying a slot layout: a :class:`SlotLayout`, or the counts
    ``set_tokens_per_adapter_slot`` takes (slot i owns the next ``layout[i]`` tokens;
    ``ep_slots`` as there). The number of slots is checked against the model's in the hooks."""
    if not isinstance(layout, SlotLayout):
        counts = check_token_counts(list(layout), len(layout))
        check_ep_slots(ep_slots, counts)
        layout = SlotLayout(counts, ep_slots)
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(PackedSeqParams)}
    out = SlotPackedSeqParams(**fields, slot_layout=layout)
    if hasattr(params, "host_cu_seqlens"):  # the bounds as the host knows them (micro_batches.py)
        out.host_cu_seqlens = params.host_cu_seqlens
    return out


def _hand(linears: list[MultiLoRALinear], layout: SlotLayout) -> None:
    if layout.n_slots != linears[0].n_slots:
        check_token_counts([0] * layout.n_slots, linears[0].n_slots)  # raises, naming both
    for linear in linears:
        linear.slot_layout = layout


def _carried(call: dict[str, Any]) -> SlotLayout | None:
    """The layout a call's arguments carry, if any."""
    for carrier in (call.get("packed_seq_params"), call.get("inference_context")):
        layout = getattr(carrier, "slot_layout", None)
        if layout is not None:
            return layout
    return None


def _layer_hooks(linears: list[MultiLoRALinear]):
    def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        layout = _carried(kwargs)
        if layout is not None:
            _hand(linears, layout)

    def post_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        layout = _carried(kwargs)
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        if layout is not None and isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda grad: _hand(linears, layout))

    return pre_hook, post_hook


def _chunk_pre_hook(linears: list[MultiLoRALinear], signature: inspect.Signature):
    def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        call = signature.bind_partial(*args, **kwargs).arguments if args else kwargs
        layout = _carried(call)
        context = call.get("inference_context")
        if layout is not None and getattr(context, "materialize_only_last_token_logits", False):
            # megatron projects only each sequence's last position: a row per sequence
            length = call["input_ids"].size(1)
            layout = SlotLayout([count // length for count in layout.counts])
        if layout is not None:
            _hand(linears, layout)

    return pre_hook


def install_slot_layout_route(model: ModelOrChunks) -> None:
    """Hook every transformer layer holding multi-LoRA linears (and each chunk holding some
    outside its layers) to take the layout from the call's carrier.

    Calling it again replaces the hooks, so linears wrapped since are included."""
    for chunk in model_chunks(model):
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
        outside = [
            m for m in chunk.modules() if isinstance(m, MultiLoRALinear) and id(m) not in in_layers
        ]
        _replace_hooks(
            chunk,
            (
                chunk.register_forward_pre_hook(
                    _chunk_pre_hook(outside, inspect.signature(chunk.forward)), with_kwargs=True
                ),
            )
            if outside
            else (),
        )


def _replace_hooks(module: torch.nn.Module, handles: Sequence[Any]) -> None:
    for handle in getattr(module, "_slot_layout_handles", ()):
        handle.remove()
    module._slot_layout_handles = tuple(handles)

"""Qwen2 (``qwen2``): Llama with q/k/v biases; with ``use_sliding_window``, a window in the
layers from ``max_window_layers`` on."""

import functools

from megatron_multilora.models.families.family import Family, Fields, named_layer_types

_FULL, _SLIDING = "full_attention", "sliding_attention"


def _from_max_window_layers(hf: Fields) -> list[str]:
    first = hf.get("max_window_layers", 28) if hf.get("use_sliding_window", False) else None
    layers = range(hf.get("num_hidden_layers", 0))
    return [_SLIDING if first is not None and i >= first else _FULL for i in layers]


windows_from_max_window_layers = functools.partial(named_layer_types, rule=_from_max_window_layers)
"""The Qwen families' layer types; before config.json named them, transformers' rule."""

FAMILY = Family("qwen2", qkv_bias=lambda hf: True, window_layers=windows_from_max_window_layers)

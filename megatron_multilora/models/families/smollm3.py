"""SmolLM3 (``smollm3``): Llama with NoPE layers (``no_rope_layers``: 0 where a layer applies
no RoPE; by default every ``no_rope_layer_interval``-th), tied embeddings by default, and with
``use_sliding_window`` a window in the layers ``layer_types`` names."""

from megatron_multilora.models.families.family import Family, Fields, named_layer_types
from megatron_multilora.models.gpt_config import GPTModelConfig

_FULL, _SLIDING = "full_attention", "sliding_attention"


def _rope_layers(hf: Fields) -> list[int]:
    """Per layer, 1 where it rotates (config.json's ``no_rope_layers``, or transformers' rule)."""
    layers = hf.get("num_hidden_layers", 0)
    interval = hf.get("no_rope_layer_interval", 4)
    rule = [int((i + 1) % interval != 0) for i in range(layers)]
    return list(hf.get("no_rope_layers", rule))


def _layer_types(hf: Fields) -> list[str]:
    """transformers windows a layer only with ``use_sliding_window`` and a window set; its
    default ``layer_types`` put the window in the NoPE layers."""
    on = bool(hf.get("use_sliding_window", False)) and hf.get("sliding_window") is not None
    rope = _rope_layers(hf)
    types = named_layer_types(hf, lambda hf: [_SLIDING if not r else _FULL for r in rope])
    return types if on else [_FULL] * len(types)


def _finish(hf: Fields, cfg: GPTModelConfig) -> None:
    rope = _rope_layers(hf)
    if len(rope) != cfg.num_layers or not set(rope) <= {0, 1}:
        hf.reject("no_rope_layers", rope, f"give each of the {cfg.num_layers} layers 0 or 1")
    cfg.no_rope_freq = [1 - r for r in rope] if 0 in rope else None
    cfg.tie_word_embeddings = bool(hf.get("tie_word_embeddings", True))


FAMILY = Family("smollm3", window_layers=_layer_types, finish=_finish)

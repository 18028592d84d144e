"""Qwen2 (``qwen2``): Llama with q/k/v biases; its window only with ``use_sliding_window``."""

from megatron_multilora.models.families.family import Family

FAMILY = Family("qwen2", qkv_bias=lambda hf: True)

"""Qwen3 (``qwen3``): Llama with RMSNorms of q and k per head (``q_norm``, ``k_norm``); its
window as Qwen2's."""

from megatron_multilora.models.families.family import Family
from megatron_multilora.models.families.qwen2 import windows_from_max_window_layers

FAMILY = Family("qwen3", qk_norm="per_head", window_layers=windows_from_max_window_layers)

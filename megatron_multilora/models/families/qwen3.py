"""Qwen3 (``qwen3``): Llama with RMSNorms of q and k per head (``q_norm``, ``k_norm``)."""

from megatron_multilora.models.families.family import Family

FAMILY = Family("qwen3", qk_norm="per_head")

"""Qwen3-MoE (``qwen3_moe``): every layer MoE (``moe_intermediate_size`` experts), q/k norms
per head."""

from megatron_multilora.models.families.family import Family
from megatron_multilora.models.families.qwen2_moe import every_layer_moe

FAMILY = Family(
    "qwen3_moe",
    moe=True,
    qk_norm="per_head",
    check=every_layer_moe,
    expert_width="moe_intermediate_size",
)

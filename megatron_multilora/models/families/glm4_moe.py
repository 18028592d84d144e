"""GLM-4.5 and GLM-4.6 (``glm4_moe``): grouped-query attention with q/k/v biases
(``attention_bias``; o_proj has none), optional per-head q/k norms (``use_qk_norm``), RoPE
over the first half of each head by default (``partial_rotary_factor``, 0.5 when left out),
``first_k_dense_replace`` dense layers, then DeepSeek-V3's MoE (sigmoid router with the
expert bias, group-limited top-k, routed scaling, ``n_shared_experts`` shared experts).
Multi-token-prediction layers a checkpoint appends are skipped, as transformers skips them."""

from megatron_multilora.models.families.deepseek_v3 import (
    add_sigmoid_moe,
    prediction_module_tensor,
)
from megatron_multilora.models.families.family import Family, Fields
from megatron_multilora.models.gpt_config import GPTModelConfig


def _finish(hf: Fields, cfg: GPTModelConfig) -> None:
    cfg.qk_layernorm = bool(hf.get("use_qk_norm", False))
    dense = min(int(hf.get("first_k_dense_replace", 1)), cfg.num_layers)
    if dense < cfg.num_layers:
        add_sigmoid_moe(hf, cfg, [0] * dense + [1] * (cfg.num_layers - dense))


FAMILY = Family(
    "glm4_moe",
    partial_rotary=True,
    rotary_share=0.5,
    qkv_bias_flag="attention_bias",
    finish=_finish,
    shared_experts="shared_experts",
    skipped=prediction_module_tensor,
)

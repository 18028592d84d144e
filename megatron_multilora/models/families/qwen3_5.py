"""Qwen3.5 (``qwen3_5``, ``qwen3_5_moe``: the published image-text checkpoints, whose
language model is read, below ``model.language_model``; and the text models alone,
``qwen3_5_text``, ``qwen3_5_moe_text``): Gated DeltaNet layers
(``layer_types``' "linear_attention", by default three of every four; see
:mod:`~megatron_multilora.models.gated_delta_net`) between attention layers whose q_proj also
projects a sigmoid output gate per head (megatron's ``attention_output_gate``), per-head q/k
norms, RoPE over a quarter of each head (``partial_rotary_factor``), and ``(1 + w)`` RMSNorms
everywhere but the DeltaNet's gated norm. Its multimodal RoPE (``mrope_section``) is plain
RoPE for text, whose three position ids are equal. The MoE variant has a gated shared expert
and renormalises its top-k softmax.

A DeltaNet layer's tensors (below ``model.layers.{i}.linear_attn.``): ``in_proj_qkv``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (fused into megatron's ``in_proj``: see
:class:`~megatron_multilora.ops.fused_rows.DeltaNetRows`), ``conv1d.weight``, ``A_log``,
``dt_bias``, ``norm.weight`` and ``out_proj.weight``.
"""

import dataclasses

from megatron_multilora.models.families.family import Family, Fields
from megatron_multilora.models.families.qwen2_moe import every_layer_moe
from megatron_multilora.models.gpt_config import DeltaNetConfig, GPTModelConfig

_KINDS = ("linear_attention", "full_attention")  # by (i + 1) % interval == 0


def _layer_types(hf: Fields) -> list[str]:
    """``layer_types``, or transformers' rule: every ``full_attention_interval``-th layer
    attention, the others linear."""
    types = hf.get("layer_types")
    if types is None:
        every = hf.get("full_attention_interval", 4)
        layers = range(hf.require("num_hidden_layers"))
        types = [_KINDS[(i + 1) % every == 0] for i in layers]
    if not set(types) <= set(_KINDS):
        hf.reject("layer_types", sorted(set(types) - set(_KINDS)), f"expected {_KINDS}")
    return list(types)


def _finish(hf: Fields, cfg: GPTModelConfig) -> None:
    if hf.get("attn_output_gate", True) is not True:
        hf.reject("attn_output_gate", hf.d["attn_output_gate"], "Qwen3.5 gates attention")
    if hf.get("hidden_act", "silu") != "silu":  # the DeltaNet's convolution and norm gate too
        hf.reject("hidden_act", hf.d["hidden_act"], "silu only")
    cfg.layer_types = _layer_types(hf)
    if len(cfg.layer_types) != cfg.num_layers:
        hf.reject("layer_types", cfg.layer_types, f"one per layer ({cfg.num_layers})")
    cfg.attention_output_gate = True
    cfg.linear_attention = DeltaNetConfig(
        linear_num_key_heads=hf.get("linear_num_key_heads", 16),
        linear_num_value_heads=hf.get("linear_num_value_heads", 32),
        linear_key_head_dim=hf.get("linear_key_head_dim", 128),
        linear_value_head_dim=hf.get("linear_value_head_dim", 128),
        linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4),
    )


def _not_text(name: str, num_layers: int) -> bool:
    """The vision tower and the multi-token-prediction head: not loaded."""
    return name.startswith(("model.visual.", "mtp."))


_COMMON = dict(
    qk_norm="per_head",
    partial_rotary=True,
    rotary_share=0.25,  # transformers' default where config.json leaves it out
    finish=_finish,
    # (1 + w): input, pre-MLP, final and q/k norms (not the DeltaNet's out_norm)
    unit_offset_norms=("layernorm.weight", "layer_norm_weight"),
    skipped=_not_text,
)

FAMILY = Family("qwen3_5_text", **_COMMON)

MOE_FAMILY = Family(
    "qwen3_5_moe_text",
    moe=True,
    renormalise_topk=True,
    check=every_layer_moe,
    expert_width="moe_intermediate_size",
    shared_expert_gate=True,
    **_COMMON,
)

# The published checkpoints: image-text models whose language model is the above.
_MULTIMODAL = dict(text_config="text_config", language_model="model.language_model")
MULTIMODAL_FAMILY = dataclasses.replace(FAMILY, model_type="qwen3_5", **_MULTIMODAL)
MULTIMODAL_MOE_FAMILY = dataclasses.replace(MOE_FAMILY, model_type="qwen3_5_moe", **_MULTIMODAL)

"""Gemma 3 text (``model_type: gemma3_text``, transformers' ``Gemma3ForCausalLM``): what its
config.json and checkpoint add to the Llama mapping of ``hf_config`` and ``hf_import``.

A Gemma 3 layer, in Hugging Face's names (``norm(x) = rms(x) * (1 + weight)`` for every norm,
q_norm/k_norm per head and model.norm included)::

    h = h + post_attention_layernorm(attention(input_layernorm(h)))
    h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

so ``post_attention_layernorm`` is a post norm (Llama's pre-MLP norm has that name). The
input embeddings are multiplied by sqrt(hidden_size), the gated MLP uses GELU's tanh
approximation, attention logits are scaled by ``query_pre_attn_scalar ** -0.5``, and the
``sliding_attention`` layers rotate with their own RoPE base (``rope_local_base_freq``), the
``full_attention`` ones with ``rope_theta`` and an optional linear scaling. Torch-free.
"""

from __future__ import annotations

from typing import Any

from megatron_multilora.models.families.family import Family, Fields
from megatron_multilora.models.gpt_config import GPTModelConfig

# transformers' Gemma3TextConfig defaults, for config.json files that leave them out.
_GLOBAL_THETA, _LOCAL_THETA, _PATTERN = 1_000_000.0, 10_000.0, 6

# Megatron layer parameter -> Gemma 3 tensor below ``model.layers.{i}.``, where the Llama
# names of hf_import differ; the post norms sit in the bias-dropout-add slots (models/gemma3.py).
LAYER_NAMES = {
    "pre_mlp_layernorm.weight": "pre_feedforward_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_feedforward_layernorm.weight",
    "self_attn_bda.norm.weight": "post_attention_layernorm.weight",
    "mlp_bda.norm.weight": "post_feedforward_layernorm.weight",
}
# Megatron parameters (suffixes) holding Gemma's (1 + w) norm weights: imported as 1 + w.
UNIT_OFFSET_NORMS = (
    "layernorm.weight",  # input, pre-MLP, final and the q/k norms
    "layer_norm_weight",  # TE's norms fused into linear_qkv / linear_fc1
    "_bda.norm.weight",  # the post norms
)


def gemma3_rope(hf: Fields) -> dict[str, Any]:
    """GPTModelConfig's RoPE fields: ``rope_parameters`` per layer type as transformers 5
    writes it, or the older top-level ``rope_theta`` / ``rope_local_base_freq`` /
    ``rope_scaling`` (which scales the full-attention layers only)."""
    params = hf.get("rope_parameters") or {}
    if params and not set(params) <= {"full_attention", "sliding_attention"}:
        hf.reject("rope_parameters", params, "expected one dict per layer type")
    if not params:
        params = {
            "full_attention": {"rope_theta": hf.get("rope_theta", _GLOBAL_THETA)},
            "sliding_attention": {"rope_theta": hf.get("rope_local_base_freq", _LOCAL_THETA)},
        }
        params["full_attention"].update(hf.get("rope_scaling") or {})
    full = params.get("full_attention") or {}
    sliding = params.get("sliding_attention") or {}
    for kind, rope, allowed in (
        ("full_attention", full, ("default", "linear")),
        ("sliding_attention", sliding, ("default",)),
    ):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in allowed or rope.get("partial_rotary_factor", 1.0) != 1.0:
            hf.reject(
                f"rope_parameters[{kind!r}]",
                rope,
                "only plain RoPE over the whole head, linearly scaled on full-attention layers",
            )
    theta = full.get("rope_theta", _GLOBAL_THETA)
    linear = full.get("rope_type", full.get("type")) == "linear"
    return {
        # GPTModelConfig.rotary_base is an int field; keep ints where the value is integral.
        "rotary_base": int(theta) if float(theta).is_integer() else float(theta),
        "local_rotary_base": float(sliding.get("rope_theta", _LOCAL_THETA)),
        "layer_types": _layer_types(hf),
        "seq_len_interpolation_factor": float(full["factor"]) if linear else None,
    }


def _layer_types(hf: Fields) -> list[str]:
    """``layer_types``, or (older config.json files) every ``sliding_window_pattern``-th layer
    full attention, the rest sliding."""
    types = hf.get("layer_types")
    if types is not None:
        return list(types)
    pattern = hf.get("sliding_window_pattern", _PATTERN)
    layers = range(hf.get("num_hidden_layers", 0))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in layers]


def set_gemma3_fields(hf: Fields, cfg: GPTModelConfig) -> None:
    """What sets Gemma 3 apart from Llama, on ``cfg``; raises ``ValueError`` for the parts of
    the model not reproduced here (logit soft-capping, bidirectional attention)."""
    act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        hf.reject("hidden_activation", act, "only gelu_pytorch_tanh is implemented")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(name) is not None:
            hf.reject(name, hf.get(name), "logit soft-capping is not implemented")
    if hf.get("use_bidirectional_attention", False):
        hf.reject("use_bidirectional_attention", True, "only causal attention is implemented")
    cfg.activation = "gelu_tanh"
    cfg.qk_layernorm = True
    cfg.tie_word_embeddings = bool(hf.get("tie_word_embeddings", True))
    cfg.post_norms = cfg.scale_embeddings = True
    cfg.softmax_scale = float(hf.get("query_pre_attn_scalar", 256)) ** -0.5


FAMILY = Family(
    "gemma3_text",
    rope=gemma3_rope,
    silu_only=False,  # GELU's tanh approximation: set_gemma3_fields checks it
    finish=set_gemma3_fields,
    window_layers=_layer_types,
    layer_tensors=LAYER_NAMES,
    unit_offset_norms=UNIT_OFFSET_NORMS,
)

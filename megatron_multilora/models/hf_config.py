"""Hugging Face ``config.json`` -> :class:`GPTModelConfig`, for the families we can import
(``models/families/``: what each declares is read here; no model type is named).

Only fields that the Megatron model reproduces exactly are accepted; anything that changes
the math and has no Megatron counterpart here (rope scaling, other attention kinds, extra biases,
other activations, dense layers mixed into an MoE stack, ...) raises ``ValueError`` naming
the model type, the field and its value.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from megatron_multilora.models.families import Family, family_of
from megatron_multilora.models.gpt_config import GPTModelConfig, YarnConfig


def read_hf_config(folder: str | os.PathLike) -> dict:
    """The ``config.json`` of a Hugging Face checkpoint folder, as a dict (the one place it
    is read); errors name the file."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found (expected a Hugging Face model folder)")
    with open(path) as f:
        try:
            config = json.load(f)
        except ValueError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def hf_to_model_config(hf_config: dict) -> GPTModelConfig:
    """The Megatron :class:`GPTModelConfig` of a Hugging Face causal LM config.

    Supports the families of ``models/families`` (each module says what it adds to
    Llama's mapping; DeepSeek-V3 and Gemma 3 map much of their config themselves).
    A sliding window shorter than max_position_embeddings becomes ``sliding_window``, with
    ``layer_types`` where only some layers have it. Mapping: num_hidden_layers -> num_layers, hidden_size,
    num_attention_heads, num_key_value_heads -> num_query_groups, head_dim -> kv_channels,
    intermediate_size -> ffn_hidden_size (and the expert width for mixtral/olmoe),
    moe_intermediate_size -> moe_ffn_hidden_size, shared_expert_intermediate_size (+ its
    sigmoid gate), vocab_size, max_position_embeddings -> max_sequence_length, rms_norm_eps,
    rope_theta -> rotary_base, tie_word_embeddings, qkv bias (qwen2 family), q/k norms
    (qwen3 per head, olmoe across heads), SwiGLU, experts / top-k and norm_topk_prob
    (renormalised top-k softmax; Mixtral always renormalises). Raises ``ValueError`` for
    unsupported model types and for fields that would change the computation.
    """
    hf = _Fields(hf_config)
    family = hf.family
    if family.text_config is not None:  # a multimodal model: its language model's
        text = dict(hf.require(family.text_config))
        if "tie_word_embeddings" in hf_config:
            text["tie_word_embeddings"] = hf_config["tie_word_embeddings"]
        return hf_to_model_config(text)
    if family.config is not None:
        return family.config(hf)
    heads = hf.require("num_attention_heads")
    hidden = hf.require("hidden_size")
    head_dim = hf.get("head_dim") or hidden // heads
    cfg = GPTModelConfig(
        num_layers=hf.require("num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        # MoE families without dense layers may leave it out: their experts' width
        ffn_hidden_size=hf.get("intermediate_size") or hf.require(family.expert_width),
        vocab_size=hf.require("vocab_size"),
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        normalization="RMSNorm",
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        activation="silu",
        gated_linear_unit=True,
        position_embedding_type="rope",
        **{**_windows(hf, family), **(family.rope(hf) if family.rope else _rope(hf, family))},
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias(hf)
        or bool(family.qkv_bias_flag and hf.get(family.qkv_bias_flag, False)),
        qk_layernorm=family.qk_norm is not None,
        qk_layernorm_across_heads=family.qk_norm == "across_heads",
        kv_channels=head_dim,
        # The HF classes of these families all default to untied embeddings.
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        hidden_dropout=0.0,
    )
    _check_math(hf, family)
    family.finish(hf, cfg)
    if family.moe:
        _add_moe(hf, cfg, family)
    return cfg


class _Fields:
    """The config dict with its model type checked, and errors that name both."""

    def __init__(self, hf_config: dict) -> None:
        self.d = hf_config
        self.model_type = hf_config.get("model_type")
        self.family = family_of(self.model_type)

    def get(self, name: str, default: Any = None) -> Any:
        value = self.d.get(name)
        return default if value is None else value

    def require(self, name: str) -> Any:
        if self.d.get(name) is None:
            raise ValueError(f"{self.model_type}: config.json lacks {name!r}")
        return self.d[name]

    def reject(self, name: str, value: Any, why: str) -> None:
        raise ValueError(f"{self.model_type}: {name}={value!r} is not supported ({why})")


def _rope(hf: _Fields, family: Family) -> dict[str, Any]:
    """RoPE fields from the old top-level ``rope_theta``/``rope_scaling`` or transformers 5's
    ``rope_parameters``: plain RoPE, or Llama 3.x scaling (``rope_type: llama3``)."""
    params = hf.d.get("rope_parameters") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        hf.reject("rope_parameters", params, "per-layer-type RoPE parameters")
    scaling = hf.d.get("rope_scaling") or params
    field = "rope_scaling" if hf.d.get("rope_scaling") else "rope_parameters"
    fields: dict[str, Any] = {}
    kind = _rope_type(scaling)
    if kind == "llama3":
        fields = dict(
            rope_scaling_factor=float(scaling["factor"]),
            rope_low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            rope_original_max_positions=int(scaling["original_max_position_embeddings"]),
        )
    elif kind == "yarn":
        fields = {"yarn": _yarn(hf, field, scaling)}
    elif kind != "default":
        hf.reject(field, scaling, "only unscaled RoPE, Llama 3 (llama3) and YaRN (yarn) scaling")
    partial = params.get(
        "partial_rotary_factor", hf.get("partial_rotary_factor", family.rotary_share)
    )
    if partial != 1.0 and not family.partial_rotary:
        hf.reject("partial_rotary_factor", partial, "RoPE must cover the whole head")
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    # GPTModelConfig.rotary_base is an int field; keep ints where the value is integral.
    fields["rotary_base"] = int(theta) if float(theta).is_integer() else float(theta)
    return {**fields, "rotary_percent": float(partial)}


def _yarn(hf: _Fields, field: str, params: dict) -> YarnConfig:
    """transformers' YaRN: ``factor`` (else max_position_embeddings over the original),
    ``attention_factor`` (else from ``mscale`` / ``mscale_all_dim`` when both are set)."""
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or hf.require("max_position_embeddings") / original
    attention = params.get("attention_factor")
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None and mscale and all_dim:

        def m(scale: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

        attention = m(mscale) / m(all_dim)
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        hf.reject(field, params, "YaRN over part of each head")
    return YarnConfig(
        factor=float(factor),
        original_max_positions=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=None if attention is None else float(attention),
    )


def _rope_type(d: dict) -> str | None:
    return d.get("rope_type", d.get("type", "default"))


def _check_math(hf: _Fields, family: Family) -> None:
    """Reject fields that would make the Hugging Face model compute something else (the
    family's own refusals too)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu" and family.silu_only:
        hf.reject("hidden_act", act, "only SwiGLU (silu) MLPs are implemented")
    for flag in ("attention_bias", "mlp_bias"):
        # Would add biases to o_proj / the MLP as well, which add_qkv_bias does not cover.
        if hf.get(flag, False) and flag != family.qkv_bias_flag:
            hf.reject(flag, hf.d[flag], "only q/k/v biases are supported")
    if hf.get("pretraining_tp", 1) != 1:
        hf.reject("pretraining_tp", hf.d["pretraining_tp"], "must be 1")
    if hf.get("clip_qkv") is not None:
        hf.reject("clip_qkv", hf.d["clip_qkv"], "q/k/v clamping is not implemented")
    family.check(hf)


def _windows(hf: _Fields, family: Family) -> dict[str, Any]:
    """``sliding_window`` (None: none, or one covering every position) and, for a family
    whose layers differ (``Family.window_layers``), ``layer_types``. Elsewhere the window is every layer's, on with
    ``use_sliding_window`` or (``window_always``) whenever set."""
    types = None
    if family.window_layers is not None:
        types = family.window_layers(hf)
        other = sorted(set(types) - {"full_attention", "sliding_attention"})
        if other:
            hf.reject("layer_types", other, "only full and sliding-window attention layers")
        windowed = "sliding_attention" in types
    else:
        windowed = hf.get("use_sliding_window", False) or family.window_always
    window = hf.get("sliding_window") if windowed else None
    if window is None or window >= hf.get("max_position_embeddings", 4096):
        return {"sliding_window": None}
    return {"sliding_window": int(window), "layer_types": types}


def _add_moe(hf: _Fields, cfg: GPTModelConfig, family: Family) -> None:
    """Experts, router and shared experts; HF routers softmax over all experts in fp32 and
    pick the top k, renormalising them when ``norm_topk_prob`` (or as the family says)."""
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not experts:
        raise ValueError(f"{hf.model_type}: config.json lacks num_experts / num_local_experts")
    cfg.num_moe_experts = int(experts)
    cfg.moe_router_topk = int(hf.require("num_experts_per_tok"))
    renormalise = family.renormalise_topk
    if renormalise is None:
        renormalise = bool(hf.get("norm_topk_prob", False))
    # Megatron: pre_softmax=False is softmax over the top-k logits, i.e. the renormalised
    # top-k of the full softmax; pre_softmax=True keeps the full-softmax probabilities.
    cfg.moe_router_pre_softmax = not renormalise
    cfg.moe_router_score_function = "softmax"
    cfg.moe_router_dtype = "fp32"
    cfg.moe_aux_loss_coeff = 0.0  # HF adds its aux loss only on request; not part of logits
    cfg.moe_ffn_hidden_size = (
        cfg.ffn_hidden_size
        if family.expert_width == "intermediate_size"
        else hf.require(family.expert_width)
    )
    if family.shared_expert_gate:
        shared = hf.get("shared_expert_intermediate_size", 0)
        if shared:
            cfg.moe_shared_expert_intermediate_size = int(shared)
            cfg.moe_shared_expert_gate = True

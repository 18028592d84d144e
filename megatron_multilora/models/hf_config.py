"""Hugging Face ``config.json`` -> :class:`GPTModelConfig`, for the families we can import.

Only fields that the Megatron model reproduces exactly are accepted; anything that changes
the math and has no Megatron counterpart here (rope scaling, sliding windows, extra biases,
other activations, dense layers mixed into an MoE stack, ...) raises ``ValueError`` naming
the model type, the field and its value.
"""

from __future__ import annotations

import json
import os
from typing import Any

from megatron_multilora.models.gpt_config import GPTModelConfig

DENSE_TYPES = ("llama", "qwen2", "qwen3")
MOE_TYPES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")
SUPPORTED_TYPES = DENSE_TYPES + MOE_TYPES
# Families whose q_norm/k_norm exist: per head (Qwen3) or over the whole projection (OLMoE).
_QK_NORM_PER_HEAD = ("qwen3", "qwen3_moe")
_QK_NORM_ACROSS_HEADS = ("olmoe",)


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

    Supports model_type llama, qwen2, qwen3 (dense) and mixtral, qwen3_moe, olmoe, qwen2_moe
    (every layer MoE). Mapping: num_hidden_layers -> num_layers, hidden_size,
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
    heads = hf.require("num_attention_heads")
    hidden = hf.require("hidden_size")
    head_dim = hf.get("head_dim") or hidden // heads
    cfg = GPTModelConfig(
        num_layers=hf.require("num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf.require("intermediate_size"),
        vocab_size=hf.require("vocab_size"),
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        normalization="RMSNorm",
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        activation="silu",
        gated_linear_unit=True,
        position_embedding_type="rope",
        rotary_base=_rope_theta(hf),
        add_bias_linear=False,
        add_qkv_bias=_qkv_bias(hf),
        qk_layernorm=hf.model_type in _QK_NORM_PER_HEAD + _QK_NORM_ACROSS_HEADS,
        qk_layernorm_across_heads=hf.model_type in _QK_NORM_ACROSS_HEADS,
        kv_channels=head_dim,
        # The HF classes of these families all default to untied embeddings.
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        hidden_dropout=0.0,
    )
    _check_math(hf)
    if hf.model_type in MOE_TYPES:
        _add_moe(hf, cfg)
    return cfg


class _Fields:
    """The config dict with its model type checked, and errors that name both."""

    def __init__(self, hf_config: dict) -> None:
        self.d = hf_config
        self.model_type = hf_config.get("model_type")
        if self.model_type not in SUPPORTED_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_TYPES)}"
            )

    def get(self, name: str, default: Any = None) -> Any:
        value = self.d.get(name)
        return default if value is None else value

    def require(self, name: str) -> Any:
        if self.d.get(name) is None:
            raise ValueError(f"{self.model_type}: config.json lacks {name!r}")
        return self.d[name]

    def reject(self, name: str, value: Any, why: str) -> None:
        raise ValueError(f"{self.model_type}: {name}={value!r} is not supported ({why})")


def _rope_theta(hf: _Fields) -> float | int:
    """rope_theta from the old top-level fields or transformers 5's ``rope_parameters``;
    only plain RoPE over the whole head is reproduced."""
    scaling = hf.d.get("rope_scaling")
    if scaling is not None and _rope_type(scaling) != "default":
        hf.reject("rope_scaling", scaling, "only unscaled RoPE is implemented")
    params = hf.d.get("rope_parameters") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        hf.reject("rope_parameters", params, "per-layer-type RoPE parameters")
    if params and _rope_type(params) != "default":
        hf.reject("rope_parameters", params, "only unscaled RoPE is implemented")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        hf.reject("partial_rotary_factor", partial, "RoPE must cover the whole head")
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    # GPTModelConfig.rotary_base is an int field; keep ints where the value is integral.
    return int(theta) if float(theta).is_integer() else float(theta)


def _rope_type(d: dict) -> str | None:
    return d.get("rope_type", d.get("type", "default"))


def _qkv_bias(hf: _Fields) -> bool:
    """Qwen2 always has q/k/v biases, Qwen2-MoE per ``qkv_bias``; the others have none."""
    if hf.model_type == "qwen2":
        return True
    if hf.model_type == "qwen2_moe":
        return bool(hf.get("qkv_bias", True))
    return False


def _check_math(hf: _Fields) -> None:
    """Reject fields that would make the Hugging Face model compute something else."""
    mt = hf.model_type
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        hf.reject("hidden_act", act, "only SwiGLU (silu) MLPs are implemented")
    for flag in ("attention_bias", "mlp_bias"):
        # Would add biases to o_proj / the MLP as well, which add_qkv_bias does not cover.
        if hf.get(flag, False):
            hf.reject(flag, hf.d[flag], "only q/k/v biases are supported")
    if hf.get("pretraining_tp", 1) != 1:
        hf.reject("pretraining_tp", hf.d["pretraining_tp"], "must be 1")
    if hf.get("clip_qkv") is not None:
        hf.reject("clip_qkv", hf.d["clip_qkv"], "q/k/v clamping is not implemented")
    _check_sliding_window(hf)
    if mt == "mixtral" and hf.get("router_jitter_noise", 0.0):
        hf.reject(
            "router_jitter_noise",
            hf.d["router_jitter_noise"],
            "router noise changes training-mode routing",
        )
    if mt in ("qwen3_moe", "qwen2_moe"):
        if hf.get("mlp_only_layers", []):
            hf.reject(
                "mlp_only_layers",
                hf.d["mlp_only_layers"],
                "dense layers inside an MoE stack are not supported",
            )
        if hf.get("decoder_sparse_step", 1) != 1:
            hf.reject(
                "decoder_sparse_step",
                hf.d["decoder_sparse_step"],
                "every layer must be an MoE layer",
            )


def _check_sliding_window(hf: _Fields) -> None:
    layer_types = hf.get("layer_types", [])
    if any(t != "full_attention" for t in layer_types):
        hf.reject("layer_types", sorted(set(layer_types)), "only full attention is implemented")
    if hf.get("use_sliding_window", False):
        hf.reject("use_sliding_window", True, "sliding-window attention is not implemented")
    window = hf.get("sliding_window")
    # Mixtral applies sliding_window whenever it is set; the Qwen families only with
    # use_sliding_window (checked above). A window covering every position changes nothing.
    if (
        hf.model_type == "mixtral"
        and window
        and window < hf.get("max_position_embeddings", window + 1)
    ):
        hf.reject("sliding_window", window, "sliding-window attention is not implemented")


def _add_moe(hf: _Fields, cfg: GPTModelConfig) -> None:
    """Experts, router and shared experts; HF routers softmax over all experts in fp32 and
    pick the top k, renormalising them when ``norm_topk_prob`` (Mixtral: always)."""
    mt = hf.model_type
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not experts:
        raise ValueError(f"{mt}: config.json lacks num_experts / num_local_experts")
    cfg.num_moe_experts = int(experts)
    cfg.moe_router_topk = int(hf.require("num_experts_per_tok"))
    renormalise = True if mt == "mixtral" else bool(hf.get("norm_topk_prob", False))
    # Megatron: pre_softmax=False is softmax over the top-k logits, i.e. the renormalised
    # top-k of the full softmax; pre_softmax=True keeps the full-softmax probabilities.
    cfg.moe_router_pre_softmax = not renormalise
    cfg.moe_router_score_function = "softmax"
    cfg.moe_router_dtype = "fp32"
    cfg.moe_aux_loss_coeff = 0.0  # HF adds its aux loss only on request; not part of logits
    cfg.moe_ffn_hidden_size = (
        hf.require("moe_intermediate_size")
        if mt in ("qwen3_moe", "qwen2_moe")
        else cfg.ffn_hidden_size
    )
    if mt == "qwen2_moe":
        shared = hf.get("shared_expert_intermediate_size", 0)
        if shared:
            cfg.moe_shared_expert_intermediate_size = int(shared)
            cfg.moe_shared_expert_gate = True

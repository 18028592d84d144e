"""The plain architecture config of a decoder-only GPT, and its checks.

Torch-free on purpose: the config schema (training/config.py) and ``mmlora submit`` read it
without waiting seconds for torch and megatron; models/gpt.py builds the model from it.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_multilora.models.mla_config import MLAConfig
from megatron_multilora.validation import Rule, at_least, positive, ranged, within

ACTIVATIONS = ("silu", "gelu", "relu", "gelu_tanh", "quick_gelu")
"""The MLP activations: names of ``torch.nn.functional`` functions; gelu_tanh is GELU's tanh
approximation (Hugging Face's gelu_pytorch_tanh), quick_gelu ``x * sigmoid(1.702 x)``
(megatron's; gpt-oss's experts)."""


_FRACTION = Rule("in (0, 1]", lambda v: 0 < v <= 1)


@dataclasses.dataclass
class YarnConfig:
    """YaRN RoPE scaling (transformers' ``rope_type: yarn``): frequencies below
    ``beta_slow`` rotations over the original context interpolated by ``factor``, above
    ``beta_fast`` kept, a ramp between; cos and sin times ``attention_factor``."""

    factor: float = ranged(1.0, at_least(1.0))
    original_max_positions: int = ranged(4096, at_least(1))
    beta_fast: float = ranged(32.0, positive())
    beta_slow: float = ranged(1.0, positive())
    truncate: bool = True
    """Round the ramp's ends to whole channels (transformers' and megatron's default)."""
    attention_factor: float | None = ranged(None, positive(optional=True))
    """None: 0.1 ln(factor) + 1."""

    def concentration(self) -> float:
        """The factor on cos and sin."""
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


@dataclasses.dataclass
class DeltaNetConfig:
    """The Gated DeltaNet layers (Qwen3.5's linear attention: ``layer_types``'
    "linear_attention" ones), in megatron's field names."""

    linear_num_key_heads: int = ranged(2, at_least(1))
    linear_num_value_heads: int = ranged(4, at_least(1))
    """A multiple of the key heads: each key head serves value heads / key heads of them."""
    linear_key_head_dim: int = ranged(16, at_least(1))
    linear_value_head_dim: int = ranged(16, at_least(1))
    linear_conv_kernel_dim: int = ranged(4, at_least(2))
    """Taps of the causal convolution over q, k and v."""


@dataclasses.dataclass
class GPTModelConfig:
    """Architecture of a decoder-only GPT; every field maps onto megatron's config."""

    num_layers: int = ranged(2, at_least(1))
    hidden_size: int = ranged(64, at_least(1))
    num_attention_heads: int = ranged(4, at_least(1))
    num_query_groups: int | None = ranged(None, at_least(1, optional=True))
    """Key/value heads (GQA); None means one per attention head."""
    ffn_hidden_size: int = ranged(128, at_least(1))
    vocab_size: int = ranged(256, at_least(1))
    max_sequence_length: int = ranged(512, at_least(1))
    sliding_window: int | None = ranged(None, at_least(1, optional=True))
    """The window layers (``layer_types``' sliding_attention ones; every layer without
    layer_types) attend to this many positions at most, their own included (Hugging Face's
    ``sliding_window``); None: no window."""
    normalization: str = "RMSNorm"
    """RMSNorm or LayerNorm."""
    norm_epsilon: float = ranged(1e-5, positive())
    activation: str = "silu"
    """silu, gelu or relu."""
    gated_linear_unit: bool = True
    """fc1 produces [gate; up] and the MLP computes act(gate) * up (SwiGLU with silu)."""
    activation_clamp: float | None = ranged(None, positive(optional=True))
    """With gated_linear_unit: gate clamped to at most this, up to [-it, it], before the
    activation (megatron's activation_func_clamp_value; gpt-oss's swiglu_limit)."""
    glu_linear_offset: float = ranged(0.0, at_least(0.0))
    """With gated_linear_unit: act(gate) * (up + this) (gpt-oss: 1)."""
    position_embedding_type: str = "rope"
    """rope, learned_absolute or none."""
    rotary_base: int = ranged(10000, positive())
    rotary_percent: float = ranged(1.0, _FRACTION)
    """The share of each head's channels that RoPE rotates (the first ones; Phi-4-mini: 0.75)."""
    rope_scaling_factor: float | None = ranged(None, at_least(1.0, optional=True))
    """Llama 3.x RoPE scaling (megatron's ``rope_scaling``): low frequencies slowed by this
    factor, high ones kept, the band between interpolated; None: unscaled RoPE."""
    rope_low_freq_factor: float = ranged(1.0, positive())
    rope_high_freq_factor: float = ranged(4.0, positive())
    rope_original_max_positions: int = ranged(8192, at_least(1))
    """The context the Llama 3 scaling was fitted to (its wavelength bands are fractions of it)."""
    yarn: YarnConfig | None = None
    """YaRN RoPE scaling over the whole head; None: none."""
    seq_len_interpolation_factor: float | None = ranged(None, at_least(1.0, optional=True))
    """Linear RoPE scaling (megatron's name): positions divided by it in the layers that
    rotate with rotary_base (Gemma 3: the global layers); None: unscaled."""
    layer_types: list[str] | None = None
    """Per layer, "full_attention", "sliding_attention" or "linear_attention" (Hugging Face's
    names): which layers have the sliding_window, (local_rotary_base) which RoPE base they
    rotate with, and which are Gated DeltaNet layers (``linear_attention``). None: every
    layer attention, with the window if any."""
    linear_attention: DeltaNetConfig | None = None
    """The shape of the "linear_attention" layers (Qwen3.5's Gated DeltaNet)."""
    attention_output_gate: bool = False
    """Attention's output times sigmoid of a gate projected with q, per head (Qwen3.5;
    megatron's name)."""
    no_rope_freq: list[int] | None = None
    """Per layer, 1 where the layer applies no RoPE (SmolLM3's NoPE layers; megatron's name);
    None: every layer rotates."""
    local_rotary_base: float | None = ranged(None, positive(optional=True))
    """Unscaled RoPE base of the sliding_attention layers (Gemma 3); None: rotary_base."""
    softmax_type: str = "vanilla"
    """Attention's softmax (megatron's name): "vanilla", or with a sink per head that takes
    a share of each row's probability: "off-by-one" (a zero logit) or "learnable" (gpt-oss's
    attention sinks, loaded with the base)."""
    softmax_scale: float | None = ranged(None, positive(optional=True))
    """Scale of the attention logits (megatron's name); None: 1/sqrt(head dim)."""
    post_norms: bool = False
    """Normalise each attention and MLP output before its residual add (Gemma's
    post_attention_layernorm and post_feedforward_layernorm)."""
    scale_embeddings: bool = False
    """Multiply the input embeddings by sqrt(hidden_size), rounded to the weight dtype (Gemma;
    tied output weights stay unscaled)."""
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    qk_layernorm_across_heads: bool = False
    """With qk_layernorm: normalise q and k over the whole projection width (all heads, as
    OLMoE does) instead of each head on its own (Qwen3); RMSNorm only."""
    kv_channels: int | None = ranged(None, at_least(1, optional=True))
    """Head dimension; None means hidden_size // num_attention_heads."""
    tie_word_embeddings: bool = False
    init_method_std: float = ranged(0.02, positive())
    attention_dropout: float = ranged(0.0, within(0.0, 1.0))
    hidden_dropout: float = ranged(0.0, within(0.0, 1.0))
    # Mixture of experts (every layer's MLP when num_moe_experts is set).
    num_moe_experts: int | None = ranged(None, at_least(1, optional=True))
    moe_router_topk: int = ranged(2, at_least(1))
    moe_ffn_hidden_size: int | None = ranged(None, at_least(1, optional=True))
    """Per-expert FFN width; None means ffn_hidden_size."""
    moe_router_score_function: str = "softmax"
    """softmax or sigmoid."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before top-k (no renormalisation of the top-k probabilities);
    False applies softmax over the chosen top-k, i.e. renormalised."""
    moe_aux_loss_coeff: float = ranged(0.0, at_least(0.0))
    """Load-balancing auxiliary loss weight; 0 disables it."""
    moe_shared_expert_intermediate_size: int | None = ranged(None, at_least(1, optional=True))
    moe_token_dispatcher_type: str = "alltoall"
    """alltoall or allgather."""
    moe_shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(x @ gate_weight.T) (Qwen2-MoE)."""
    moe_router_dtype: str | None = None
    """None (the model dtype), "fp32" or "fp64": precision of the router logits and softmax."""
    moe_layer_freq: list[int] | None = None
    """Per layer, 1 for an MoE MLP and 0 for a dense one (DeepSeek-V3's first dense layers);
    None: every layer MoE."""
    moe_router_enable_expert_bias: bool = False
    """A per-expert bias added to the sigmoid scores for choosing experts only (DeepSeek-V3's
    e_score_correction_bias); loaded from the checkpoint and never updated here."""
    moe_router_num_groups: int | None = ranged(None, at_least(1, optional=True))
    """Group-limited routing: experts in this many groups, ..."""
    moe_router_group_topk: int | None = ranged(None, at_least(1, optional=True))
    """... of which each token picks this many (by their top scores) before its top-k."""
    moe_router_topk_scaling_factor: float | None = ranged(None, positive(optional=True))
    """Routing weights are multiplied by it (DeepSeek-V3's routed_scaling_factor)."""
    mla: MLAConfig | None = None
    """Multi-latent attention instead of megatron's fused q/k/v attention; None: the latter."""
    # Activation recompute.
    recompute_granularity: str | None = None
    """"full" recomputes each transformer layer; "selective" the modules listed below."""
    recompute_modules: list[str] | None = None
    """With selective recompute, e.g. ["moe"] or ["core_attn"] (megatron's names)."""

    def check(
        self,
        tensor_model_parallel_size: int,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: int | None = None,
    ) -> list[str]:
        """Problems with this config under the given parallel sizes; empty when fine."""
        tp = tensor_model_parallel_size
        groups = self.num_query_groups or self.num_attention_heads
        problems = []
        chunks = pipeline_model_parallel_size * (virtual_pipeline_model_parallel_size or 1)
        if self.num_layers % chunks:
            vpp = virtual_pipeline_model_parallel_size
            problems.append(
                f"num_layers={self.num_layers} does not split into pipeline "
                f"{pipeline_model_parallel_size} x virtual stages {vpp or 1} = {chunks} equal "
                f"model chunks; choose pipeline and virtual sizes whose product divides "
                f"{self.num_layers}"
            )
        if self.num_attention_heads % groups:
            problems.append(
                f"num_attention_heads={self.num_attention_heads} is not divisible "
                f"by num_query_groups={groups}"
            )
        for name, value in (
            ("num_attention_heads", self.num_attention_heads),
            ("num_query_groups", groups),
            ("ffn_hidden_size", self.ffn_hidden_size),
            ("vocab_size", self.vocab_size),
        ):
            if value % tp:
                problems.append(f"{name}={value} is not divisible by tensor parallel size {tp}")
        if self.linear_attention is not None and self.linear_attention.linear_num_key_heads % tp:
            problems.append(
                f"linear_attention.linear_num_key_heads="
                f"{self.linear_attention.linear_num_key_heads} is not divisible by tensor "
                f"parallel size {tp}"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            problems.append(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; set kv_channels"
            )
        if self.num_moe_experts is not None:
            if not 1 <= self.moe_router_topk <= self.num_moe_experts:
                problems.append(
                    f"moe_router_topk={self.moe_router_topk} must be in "
                    f"1..num_moe_experts={self.num_moe_experts}"
                )
            if self.moe_token_dispatcher_type not in ("alltoall", "allgather"):
                problems.append(
                    f"moe_token_dispatcher_type={self.moe_token_dispatcher_type!r}: "
                    "use 'alltoall' or 'allgather'"
                )
        for name, value, allowed in (
            ("normalization", self.normalization, ("RMSNorm", "LayerNorm")),
            (
                "position_embedding_type",
                self.position_embedding_type,
                ("rope", "learned_absolute", "none"),
            ),
            ("moe_router_score_function", self.moe_router_score_function, ("softmax", "sigmoid")),
            ("recompute_granularity", self.recompute_granularity, (None, "full", "selective")),
            ("softmax_type", self.softmax_type, ("vanilla", "off-by-one", "learnable")),
        ):
            if value not in allowed:
                problems.append(f"{name}={value!r}: choose one of {allowed}")
        if self.qk_layernorm_across_heads and not (
            self.qk_layernorm and self.normalization == "RMSNorm"
        ):
            problems.append(
                "qk_layernorm_across_heads needs qk_layernorm=True and normalization='RMSNorm'"
            )
        if self.moe_router_dtype not in (None, "fp32", "fp64"):
            problems.append(
                f"moe_router_dtype={self.moe_router_dtype!r}: choose one of (None, 'fp32', 'fp64')"
            )
        if self.mla is not None:
            problems += self.mla.check()
        if self.yarn is not None:
            others = {
                "rotary_percent below 1": self.rotary_percent != 1.0,
                "rope_scaling_factor": self.rope_scaling_factor is not None,
                "local_rotary_base": self.local_rotary_base is not None,
                "mla (its YaRN is mla's)": self.mla is not None,
                "a position_embedding_type other than rope": self.position_embedding_type != "rope",
            }
            problems += [f"yarn cannot go with {name}" for name, on in others.items() if on]
        freq = self.moe_layer_freq
        if freq is not None and (len(freq) != self.num_layers or not set(freq) <= {0, 1}):
            problems.append(
                f"moe_layer_freq={list(freq)}: give each of the num_layers={self.num_layers} "
                "layers 0 (dense MLP) or 1 (MoE)"
            )
        nope = self.no_rope_freq
        if nope is not None and (len(nope) != self.num_layers or not set(nope) <= {0, 1}):
            problems.append(
                f"no_rope_freq={list(nope)}: give each of the num_layers={self.num_layers} "
                "layers 1 (no RoPE) or 0"
            )
        if self.activation not in ACTIVATIONS:
            problems.append(f"activation={self.activation!r}: choose one of {sorted(ACTIVATIONS)}")
        return problems + _layer_type_problems(self)


def _layer_type_problems(cfg: GPTModelConfig) -> list[str]:
    types = cfg.layer_types
    linear = cfg.linear_attention
    if types is None:
        problems = ["local_rotary_base needs layer_types"] if cfg.local_rotary_base else []
        return problems + (["linear_attention needs layer_types"] if linear else [])
    kinds = ("full_attention", "sliding_attention", "linear_attention")
    if len(types) != cfg.num_layers or not set(types) <= set(kinds):
        return [f"layer_types={types}: one of {kinds} per layer ({cfg.num_layers})"]
    if ("linear_attention" in types) != (linear is not None):
        return ["layer_types' linear_attention layers and linear_attention go together"]
    if linear is not None and linear.linear_num_value_heads % linear.linear_num_key_heads:
        return [
            f"linear_attention: linear_num_value_heads={linear.linear_num_value_heads} is "
            f"not a multiple of linear_num_key_heads={linear.linear_num_key_heads}"
        ]
    return []

"""Tiny random Hugging Face models of every importable family, built offline, and the
logits of both sides, shared by the single- and multi-process import tests."""

from __future__ import annotations

import torch

VOCAB, SEQ = 128, 16
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
    rms_norm_eps=1e-6,
    # Large enough that attention and MLPs move the logits: a wrong mapping then
    # shows as O(1) logit errors (std 0.02 leaves the logits near the embeddings).
    initializer_range=0.2,
)
# YaRN fitted to a context shorter than the test sequences, its ramp's ends unrounded
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=8,
    beta_fast=8.0,
    beta_slow=0.5,
    truncate=False,
)
QWEN3_5 = dict(
    head_dim=16,
    full_attention_interval=2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
)
FAMILIES = {
    "llama": dict(rope_theta=50000.0),
    # Llama 3.x RoPE scaling with bands other than megatron's defaults (1, 4, 8192), fitted to
    # a context short enough that the test sequences' angles move.
    "llama3": dict(
        model_type="llama",
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=2.0,
            high_freq_factor=8.0,
            original_max_position_embeddings=64,
        ),
    ),
    # Windows shorter than the test sequences (16 tokens): several windows a sequence.
    "mistral": dict(sliding_window=5),
    # fused qkv_proj and gate_up_proj; RoPE over half of each head
    "phi3": dict(partial_rotary_factor=0.5, sliding_window=6),
    # q/k/v biases; a window in the second layer only
    "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "qwen3": dict(head_dim=32),  # head_dim != hidden / heads; per-head q/k norms
    "qwen3_yarn": dict(
        model_type="qwen3",
        rope_parameters=YARN,
    ),
    # Post norms, (1 + w) norms, scaled embeddings, gelu-tanh, softmax scale != head_dim**-0.5;
    # layers alternate sliding (RoPE base 500, a 5-token window) and full (50000).
    "gemma3_text": dict(
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=5,
        sliding_window_pattern=2,
        rope_theta=50000.0,
        rope_local_base_freq=500.0,
    ),
    # NoPE in the second layer, which has the window; tied embeddings (its default)
    "smollm3": dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=5),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=6),
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
    ),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),  # q/k norm
    # across heads
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
    ),
    # a dense first layer, then DeepSeek-V3's MoE; q/k/v biases, q/k norms, half-head RoPE
    "glm4_moe": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.7,
        norm_topk_prob=True,
        attention_bias=True,
        use_qk_norm=True,
    ),
    # sinks, alternating 5-token windows and full layers, YaRN, biased experts, clamped GLU
    "gpt_oss": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=5,
        swiglu_limit=0.5,  # small enough that the tiny model's gates and ups are clamped
        rope_parameters=YARN,
    ),
    # Gated DeltaNet then gated attention (RoPE over a quarter of each head); DeltaNet heads
    # with key and value widths of their own, two value heads per key head
    "qwen3_5_text": QWEN3_5,
    "qwen3_5_moe_text": dict(
        QWEN3_5,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
}
DENSE = (
    "llama",
    "llama3",
    "mistral",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_yarn",
    "gemma3_text",
    "smollm3",
    "qwen3_5_text",
)
MOE = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "glm4_moe", "gpt_oss", "qwen3_5_moe_text")
# Multi-latent attention, a dense layer then MoE layers: kept out of FAMILIES, whose tests
# assume 2 layers and q/k/v attention (tests/*/test_deepseek_v3*.py run it).
MLA_FAMILIES = {
    "deepseek_v3": dict(
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.7,
        norm_topk_prob=True,
    ),
}


def make_hf_model(model_type: str, seed: int = 0, **overrides):
    """A random fp32 ``AutoModelForCausalLM`` of ``FAMILIES[model_type]`` (same weights for
    the same seed), with norm weights and biases moved off their 1/0 init so they are tested too."""
    import transformers

    family = FAMILIES[model_type] if model_type in FAMILIES else MLA_FAMILIES[model_type]
    kwargs = {**COMMON, **family, **overrides}
    cfg = transformers.AutoConfig.for_model(kwargs.pop("model_type", model_type), **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias, zero at init
            if name.endswith("e_score_correction_bias"):
                b.add_(0.3 * torch.randn(b.shape, generator=gen))
    return model


def token_batch(seed: int = 0, batch: int = 3, seq: int = SEQ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=gen)


def packed(lengths: list[int]):
    """megatron's thd parameters and the position ids of sequences of ``lengths`` packed
    into one row (each from position 0)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    ends = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=ends,
        cu_seqlens_kv=ends,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    return params, torch.cat([torch.arange(n) for n in lengths])[None]


@torch.no_grad()
def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits


@torch.no_grad()
def megatron_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """``[b, s, vocab]``, gathered over tensor-parallel ranks."""
    positions = torch.arange(ids.size(1))[None].expand_as(ids)
    return model(ids, positions, None, runtime_gather_output=True)


def add_skipped_mlp_deltas(wrapped, folder) -> None:
    """peft 0.21 on transformers 5 retargets ``gate_proj``/``up_proj``/``down_proj`` of an MoE
    model to its fused experts alone (which it adapts correctly), so the dense layers' MLP and
    the shared experts (Qwen3.5-MoE: but their down_proj) stay unadapted: add their exported
    deltas into the weights by hand."""
    import json

    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    params = dict(wrapped.named_parameters())
    with torch.no_grad():
        for key in [k for k in tensors if k.endswith("lora_A.weight") and ".experts." not in k]:
            module = key[: -len(".lora_A.weight")]
            if f"{module}.weight" not in params:
                continue  # peft adapted it (wrapped: base_layer.weight)
            delta = scale * tensors[key.replace("lora_A", "lora_B")] @ tensors[key]
            params[f"{module}.weight"].add_(delta)

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
FAMILIES = {
    "llama": dict(rope_theta=50000.0),
    "qwen2": {},  # q/k/v biases
    "qwen3": dict(head_dim=32),  # head_dim != hidden / heads; per-head q/k norms
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
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
}
DENSE = ("llama", "qwen2", "qwen3")
MOE = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")


def make_hf_model(model_type: str, seed: int = 0, **overrides):
    """A random fp32 ``AutoModelForCausalLM`` of ``model_type`` (same weights for the same
    seed), with norm weights and biases moved off their 1/0 init so they are tested too."""
    import transformers

    kwargs = {**COMMON, **FAMILIES[model_type], **overrides}
    cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def token_batch(seed: int = 0, batch: int = 3, seq: int = SEQ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=gen)


@torch.no_grad()
def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits


@torch.no_grad()
def megatron_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """``[b, s, vocab]``, gathered over tensor-parallel ranks."""
    positions = torch.arange(ids.size(1))[None].expand_as(ids)
    return model(ids, positions, None, runtime_gather_output=True)

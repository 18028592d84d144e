"""Independent references for the multi-LoRA math, written token by token.

Nothing here uses the package's grouped GEMMs, segment bookkeeping or collectives: each
token's output is computed from its own slot's full (unsharded) factors.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclasses.dataclass
class SlotFactors:
    a: torch.Tensor  # [dim, in], leaf with grad
    b: torch.Tensor  # [out, dim], leaf with grad
    rank: int
    alpha: float


def random_slots(n: int, dim: int, in_f: int, out_f: int, ranks: list[int], alphas: list[float],
                 gen: torch.Generator) -> list[SlotFactors]:
    """Random factors with the padded rank already zero (the layer's invariant)."""
    slots = []
    for i in range(n):
        a = torch.randn(dim, in_f, generator=gen) * 0.3
        b = torch.randn(out_f, dim, generator=gen) * 0.3
        a[ranks[i]:] = 0
        b[:, ranks[i]:] = 0
        slots.append(SlotFactors(a.requires_grad_(), b.requires_grad_(), ranks[i], alphas[i]))
    return slots


def lora_reference(x: torch.Tensor, base_w: torch.Tensor, slots: list[SlotFactors],
                   counts: list[int], mask: torch.Tensor | None = None) -> torch.Tensor:
    """``y_t = W x_t + (alpha_s / r_s) * B_s[:, :r_s] @ A_s[:r_s] @ (m_t * x_t)``, per token."""
    rows, t = [], 0
    for s, c in enumerate(counts):
        f = slots[s]
        for _ in range(c):
            xt = x[t] if mask is None else x[t] * mask[t]
            lora = f.b[:, :f.rank] @ (f.a[:f.rank] @ xt)
            rows.append(base_w @ x[t] + (f.alpha / f.rank) * lora)
            t += 1
    return torch.stack(rows)


def linear_config(tp: int = 1, sequence_parallel: bool = False,
                  dtype: torch.dtype = torch.float32) -> TransformerConfig:
    """A megatron config carrying only what a standalone parallel linear reads."""
    return TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=4, tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel, params_dtype=dtype, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, bf16=dtype == torch.bfloat16)

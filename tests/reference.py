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


def random_slots(
    n: int,
    dim: int,
    in_f: int,
    out_f: int,
    ranks: list[int],
    alphas: list[float],
    gen: torch.Generator,
) -> list[SlotFactors]:
    """Random factors with the padded rank already zero (the layer's invariant)."""
    slots = []
    for i in range(n):
        a = torch.randn(dim, in_f, generator=gen) * 0.3
        b = torch.randn(out_f, dim, generator=gen) * 0.3
        a[ranks[i] :] = 0
        b[:, ranks[i] :] = 0
        slots.append(SlotFactors(a.requires_grad_(), b.requires_grad_(), ranks[i], alphas[i]))
    return slots


def lora_reference(
    x: torch.Tensor,
    base_w: torch.Tensor,
    slots: list[SlotFactors],
    counts: list[int],
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y_t = W x_t + (alpha_s / r_s) * B_s[:, :r_s] @ A_s[:r_s] @ (m_t * x_t)``, per token."""
    rows, t = [], 0
    for s, c in enumerate(counts):
        f = slots[s]
        for _ in range(c):
            xt = x[t] if mask is None else x[t] * mask[t]
            lora = f.b[:, : f.rank] @ (f.a[: f.rank] @ xt)
            rows.append(base_w @ x[t] + (f.alpha / f.rank) * lora)
            t += 1
    return torch.stack(rows)


def linear_config(
    tp: int = 1, sequence_parallel: bool = False, dtype: torch.dtype = torch.float32
) -> TransformerConfig:
    """A megatron config carrying only what a standalone parallel linear reads."""
    return TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=4,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bf16=dtype == torch.bfloat16,
    )


@dataclasses.dataclass
class ExpertFactors:
    a: torch.Tensor  # [E, dim, in], leaf with grad
    b: torch.Tensor  # [E, out, dim], leaf with grad
    rank: int
    alpha: float


def moe_reference(
    x: torch.Tensor,
    router_w: torch.Tensor,
    topk: int,
    w1: torch.Tensor,
    w2: torch.Tensor,
    fc1: list[ExpertFactors],
    fc2: list[ExpertFactors],
    counts: list[int],
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    glu=lambda g, u: torch.nn.functional.silu(g) * u,
) -> tuple[torch.Tensor, list[int]]:
    """A token-choice MoE with gated experts and per-(slot, expert) LoRA, token by token.

    Router: softmax over the top-k logits. Expert e on token t of slot s:
    ``fc2_e(glu(g, u))`` (SwiGLU by default) with ``[g; u] = fc1_e(x_t)``, each linear
    ``W_e x + b_e + (alpha_s / r_s) B_{s,e}[:, :r] A_{s,e}[:r] x``; ``biases``: the router's,
    fc1's ``[E, 2 ffn]`` and fc2's ``[E, hidden]`` (none by default). Returns the output and
    the number of (token, expert) assignments each expert received.
    """
    router_b, b1, b2 = biases or (0.0, torch.zeros(w1.shape[:2]), torch.zeros(w2.shape[:2]))

    def lora_linear(w, f, e, v, b):
        r = f.rank
        return w[e] @ v + b[e] + (f.alpha / r) * (f.b[e][:, :r] @ (f.a[e][:r] @ v))

    rows, per_expert, t = [], [0] * w1.size(0), 0
    for s, c in enumerate(counts):
        for _ in range(c):
            logits = router_w @ x[t] + router_b
            top_v, top_i = logits.topk(topk)
            probs = torch.softmax(top_v, dim=0)
            y = torch.zeros(w2.size(1))
            for p, e in zip(probs, top_i.tolist()):
                per_expert[e] += 1
                h = lora_linear(w1, fc1[s], e, x[t], b1)
                g, u = h.chunk(2)
                y = y + p * lora_linear(w2, fc2[s], e, glu(g, u), b2)
            rows.append(y)
            t += 1
    return torch.stack(rows), per_expert


def dispatch_slot_ids(
    model: torch.nn.Module, counts: list[int], hidden: int, seed: int = 7
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run layer 0's MoE on tokens whose first feature is their slot id; return (slot ids as
    the experts received them in the hidden states, slot ids from the co-permutation)."""
    from megatron_multilora import set_tokens_per_adapter_slot

    moe = model.decoder.layers[0].mlp
    seen = {}

    def capture(module, args):
        routing = module.linear_fc1.routing
        seen["dispatched"] = args[0][:, 0].round().long()
        seen["routed"] = routing.segments.label_of_row[routing.inverse_idx]

    handle = moe.experts.register_forward_pre_hook(capture)  # runs after the routing hook
    x = torch.randn(sum(counts), 1, hidden, generator=torch.Generator().manual_seed(seed))
    x[:, 0, 0] = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).float()
    set_tokens_per_adapter_slot(model, counts)
    moe(x)
    handle.remove()
    return seen["dispatched"], seen["routed"]

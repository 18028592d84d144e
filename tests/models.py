"""The tests' multi-LoRA models and examples, built one way: the wrapping every parallel
layout's test compares against its unsharded reference, and the random examples the step
tests train on."""

from __future__ import annotations

import torch

import megatron_multilora as mm
from megatron_multilora.data.datasets import Example


def with_slots(
    model: torch.nn.Module | list[torch.nn.Module],
    dim: int,
    ranks: list[int],
    alphas: list[float],
    **lora: object,
) -> torch.nn.Module | list[torch.nn.Module]:
    """``model`` (or its pipeline chunks) with ``len(ranks)`` slots of max rank ``dim``, B
    drawn non-zero so that every factor gets a gradient, each slot at its rank and alpha
    (alpha 0: left unclaimed). ``lora``: further ``apply_multi_lora`` arguments."""
    mm.apply_multi_lora(model, len(ranks), dim, 1.0, row_init_method="normal", **lora)
    for slot, (rank, alpha) in enumerate(zip(ranks, alphas)):
        if alpha:
            mm.init_adapter_slot(model, slot, rank, alpha)
    return model


def random_example(n: int, vocab: int, gen: torch.Generator) -> Example:
    """``n`` random tokens (never 0, the pad id): the first third prompt, the rest trained."""
    tokens = tuple(torch.randint(1, vocab, (n,), generator=gen).tolist())
    return Example(tokens, tuple([False] * (n // 3) + [True] * (n - 1 - n // 3)))


# The tests' tiny GPT: 2 layers, hidden 32, grouped-query attention (4 heads, 2 groups),
# vocabulary 64; a test changes what it is about (tiny_gpt(num_moe_experts=4, ...)).
TINY_GPT = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=48,
    vocab_size=64,
)


def tiny_gpt(**changes: object) -> mm.GPTModelConfig:
    return mm.GPTModelConfig(**{**TINY_GPT, **changes})

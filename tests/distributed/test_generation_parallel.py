"""Greedy generation at TP=2: megatron's KV cache gives the tokens of re-running the prefix."""

import torch

from megatron_multilora.training.step.generation import greedy_generate
from tests.distributed.conftest import assert_all_ranks
from tests.distributed.harness import N, build
from tests.models import tiny_gpt

CFG = tiny_gpt(
    gated_linear_unit=True,
)


def test_tp2_kv_cache_generates_the_uncached_tokens(layout):
    layout(tp=2)
    model = build(CFG, ddp=False)  # random non-zero adapters in every slot, same on both ranks
    gen = torch.Generator().manual_seed(0)
    prompts = [
        (i % N, torch.randint(3, 64, (1 + i % 5,), generator=gen).tolist()) for i in range(7)
    ]

    def run(cache):
        return greedy_generate(
            model, prompts, N, max_new_tokens=5, eos_id=-1, pad_multiple=1, pad_id=0, kv_cache=cache
        )

    uncached, cached = run(False), run(True)
    failures = [] if cached == uncached else [f"cached {cached} != uncached {uncached}"]
    if len({tuple(g) for g in uncached}) < 2:
        failures.append(f"generations do not differ between slots/prompts: {uncached}")
    assert_all_ranks(failures)

"""Benchmark one multi-LoRA layer: forward+backward time and ratios measured side by side.

    .venv/bin/python scripts/bench_layers.py [--layer dense|moe|both] [--hidden 1024
        --tokens 4096 --slots 8 --rank 16 --experts 8 --dtype fp32]

Variants, all on the same frozen base and the same tokens:
  base      the frozen base alone (the limit the LoRA overhead is measured against)
  multi-N   the multi-LoRA layer with N slots, tokens spread over the slots
  multi-1   the multi-LoRA layer with 1 slot holding all tokens
  naive-N   the base plus a Python loop of two matmuls per slot (dense) or per
            (slot, expert) pair (MoE): what a PEFT-style loop does
dense: a column-parallel linear hidden -> hidden. moe: a grouped expert linear
hidden -> hidden over ``--experts`` experts, rows in expert-major order as the dispatcher
delivers them, each row's slot drawn at random. Each round runs every variant once, in turn,
so machine noise hits all of them alike; figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Callable

import torch

import megatron_multilora as mm  # first: it quiets megatron's CPU import notices
from megatron.core.tensor_parallel.layers import ColumnParallelLinear  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron_multilora.layers.slot_tokens import SlotTokens  # noqa: E402
from megatron_multilora.models.torch_modules import TorchGroupedLinear  # noqa: E402
from megatron_multilora.routing.slot_routing import build_expert_slot_routing  # noqa: E402


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def config(hidden: int, dtype: torch.dtype) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1,
                             params_dtype=dtype, use_cpu_initialization=True,
                             gradient_accumulation_fusion=False, bf16=dtype == torch.bfloat16)


def dense_case(args, dtype) -> tuple[dict[str, Callable], tuple]:
    base = ColumnParallelLinear(args.hidden, args.hidden, config=config(args.hidden, dtype),
                                init_method=torch.nn.init.xavier_normal_, bias=False,
                                gather_output=False, skip_bias_add=True)
    base.weight.requires_grad_(False)

    def multi(n: int) -> mm.MultiLoRALinear:
        layer = mm.MultiLoRALinear(base, n, args.rank, 2.0 * args.rank, f"bench.{n}",
                                   row_init_method="normal")
        layer.slot_tokens = SlotTokens([args.tokens // n + (i < args.tokens % n) for i in range(n)])
        return layer

    multi_n = multi(args.slots)

    def naive(x: torch.Tensor) -> torch.Tensor:
        y, _ = base(x)
        parts = []
        for s, seg in enumerate(torch.split(x.view(-1, args.hidden), multi_n.slot_tokens.counts)):
            slot = multi_n.adapters[s]
            scale = float(slot.alpha / slot.rank)
            parts.append((seg @ slot.linear_in.weight.t()) @ slot.linear_out.weight.t() * scale)
        return y + torch.cat(parts).view_as(y)

    x = torch.randn(args.tokens, 1, args.hidden, dtype=dtype, requires_grad=True)
    variants = {"base": base, f"multi-{args.slots}": multi_n, "multi-1": multi(1),
                f"naive-{args.slots}": naive}
    return {k: (lambda f: lambda: f(x))(f) for k, f in variants.items()}, (x,)


def moe_case(args, dtype) -> tuple[dict[str, Callable], tuple]:
    e = args.experts
    base = TorchGroupedLinear(e, args.hidden, args.hidden, config=config(args.hidden, dtype),
                              init_method=torch.nn.init.xavier_normal_, bias=False,
                              skip_bias_add=False, is_expert=True)
    for p in base.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    m_splits = torch.bincount(torch.randint(0, e, (args.tokens,), generator=gen), minlength=e).tolist()

    def multi(n: int) -> mm.MultiLoRAGroupedExpertLinear:
        layer = mm.MultiLoRAGroupedExpertLinear(base, n, args.rank, 2.0 * args.rank,
                                                f"bench.moe.{n}", e, row_init_method="normal")
        slot = torch.randint(0, n, (args.tokens,), generator=torch.Generator().manual_seed(1))
        layer.routing = build_expert_slot_routing(slot, m_splits, n, e)
        return layer

    multi_n = multi(args.slots)
    routing = multi_n.routing
    pairs = [(g // e, g % e, seg) for g, seg in enumerate(
        torch.split(routing.sort_idx, list(routing.segments.counts)))]

    def naive(x: torch.Tensor) -> torch.Tensor:
        y, _ = base(x, m_splits)
        delta = torch.zeros_like(y)
        for s, ex, rows in pairs:  # one pair of matmuls per (slot, expert)
            slot = multi_n.adapters[s]
            scale = float(slot.alpha / slot.rank)
            h = x.index_select(0, rows) @ slot.linear_in.weight[ex].t()
            delta = delta.index_add(0, rows, (h @ slot.linear_out.weight[ex].t()) * scale)
        return y + delta

    x = torch.randn(args.tokens, args.hidden, dtype=dtype, requires_grad=True)
    variants = {"base": lambda: base(x, m_splits), f"multi-{args.slots}": lambda: multi_n(x, m_splits),
                "multi-1": (lambda m1: lambda: m1(x, m_splits))(multi(1)),
                f"naive-{args.slots}": lambda: naive(x)}
    return variants, (x,)


def time_variants(variants: dict[str, Callable], leaves: tuple, rounds: int, warmup: int) -> dict:
    times: dict[str, list[float]] = {name: [] for name in variants}
    grad = None
    for r in range(warmup + rounds):
        for name, fn in variants.items():
            for leaf in leaves:
                leaf.grad = None
            start = time.perf_counter()
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            grad = torch.randn_like(out) if grad is None else grad
            out.backward(grad)
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def report(title: str, med: dict[str, float], slots: int, unit: str) -> None:
    print(title)
    for name, t in med.items():
        print(f"  {name:10s} {t * 1e3:8.2f} ms")
    n = f"multi-{slots}"
    print("  ratios (same run):")
    for label, ratio in ((f"{slots} slots vs 1 slot, same tokens", med[n] / med["multi-1"]),
                         (f"grouped vs naive loop per {unit}", med[n] / med[f"naive-{slots}"]),
                         ("multi-LoRA layer vs frozen base alone", med[n] / med["base"])):
        print(f"    {label:42s} {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layer", choices=["dense", "moe", "both"], default="both")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]

    mm.init_parallel(seed=0)
    print(f"hardware: {cpu_name()}, {torch.get_num_threads()} threads; torch {torch.__version__}")
    print(f"shape: hidden {args.hidden} -> {args.hidden}, {args.tokens} tokens, {args.slots} slots "
          f"of rank {args.rank}, {args.dtype}; median of {args.rounds} rounds of fwd+bwd")
    if args.layer in ("dense", "both"):
        report("dense (column-parallel linear):",
               time_variants(*dense_case(args, dtype), args.rounds, args.warmup), args.slots, "slot")
    if args.layer in ("moe", "both"):
        report(f"moe (grouped expert linear, {args.experts} experts):",
               time_variants(*moe_case(args, dtype), args.rounds, args.warmup), args.slots,
               "(slot, expert)")
    mm.destroy_parallel(destroy_process_group=True)


if __name__ == "__main__":
    main()

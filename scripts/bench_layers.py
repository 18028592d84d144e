"""Benchmark one multi-LoRA layer: forward+backward time and ratios measured side by side.

    .venv/bin/python scripts/bench_layers.py [--hidden 1024 --tokens 4096 --slots 8 --rank 16]

Variants, all on the same frozen base linear (hidden -> hidden, TP=1) and the same tokens:
  base      the frozen base linear alone (the limit LoRA overhead is measured against)
  multi-N   MultiLoRALinear with N slots, tokens split evenly over the slots
  multi-1   MultiLoRALinear with 1 slot holding all tokens
  naive-N   the base plus a per-slot Python loop of two matmuls (what a PEFT-style loop does)
Each round runs every variant once, in turn, so machine noise hits all of them alike; the
figures are medians over rounds.
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


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def make_base(hidden: int, dtype: torch.dtype) -> ColumnParallelLinear:
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1,
                            params_dtype=dtype, use_cpu_initialization=True,
                            gradient_accumulation_fusion=False, bf16=dtype == torch.bfloat16)
    base = ColumnParallelLinear(hidden, hidden, config=cfg, init_method=torch.nn.init.xavier_normal_,
                                bias=False, gather_output=False, skip_bias_add=True)
    base.weight.requires_grad_(False)
    return base


def make_multi(base: torch.nn.Module, slots: int, rank: int, tokens: int) -> mm.MultiLoRALinear:
    layer = mm.MultiLoRALinear(base, slots, rank, 2.0 * rank, f"bench.{slots}",
                               row_init_method="normal")
    counts = [tokens // slots + (i < tokens % slots) for i in range(slots)]
    layer.slot_tokens = mm.layers.slot_tokens.SlotTokens(counts)
    return layer


def naive_loop(layer: mm.MultiLoRALinear) -> Callable[[torch.Tensor], torch.Tensor]:
    """Same weights as ``layer``; one pair of matmuls per slot, concatenated."""
    counts = layer.slot_tokens.counts

    def forward(x: torch.Tensor) -> torch.Tensor:
        y, _ = layer.to_wrap(x)
        x2, parts = x.view(-1, x.size(-1)), []
        for s, seg in enumerate(torch.split(x2, counts)):
            slot = layer.adapters[s]
            scale = float(slot.alpha / slot.rank)
            parts.append((seg @ slot.linear_in.weight.t()) @ slot.linear_out.weight.t() * scale)
        return y + torch.cat(parts).view_as(y)

    return forward


def fwd_bwd(fn: Callable[[torch.Tensor], object], x: torch.Tensor, grad: torch.Tensor) -> float:
    start = time.perf_counter()
    out = fn(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]

    mm.init_parallel(seed=0)
    base = make_base(args.hidden, dtype)
    multi_n = make_multi(base, args.slots, args.rank, args.tokens)
    multi_1 = make_multi(base, 1, args.rank, args.tokens)
    variants = {
        "base": base,
        f"multi-{args.slots}": multi_n,
        "multi-1": multi_1,
        f"naive-{args.slots}": naive_loop(multi_n),
    }
    x = torch.randn(args.tokens, 1, args.hidden, dtype=dtype, requires_grad=True)
    grad = torch.randn(args.tokens, 1, args.hidden, dtype=dtype)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.warmup + args.rounds):
        for name, fn in variants.items():
            x.grad = None
            t = fwd_bwd(fn, x, grad)
            if r >= args.warmup:
                times[name].append(t)
    med = {name: statistics.median(ts) for name, ts in times.items()}

    print(f"hardware: {cpu_name()}, {torch.get_num_threads()} threads; torch {torch.__version__}")
    print(f"shape: hidden {args.hidden} -> {args.hidden}, {args.tokens} tokens, {args.slots} slots "
          f"of rank {args.rank}, {args.dtype}; median of {args.rounds} rounds (fwd+bwd)")
    for name, t in med.items():
        print(f"  {name:10s} {t * 1e3:8.2f} ms")
    n = f"multi-{args.slots}"
    print(f"ratios (same run):")
    print(f"  {args.slots} slots vs 1 slot, same tokens     {med[n] / med['multi-1']:.2f}x")
    print(f"  grouped vs naive per-slot loop         {med[n] / med[f'naive-{args.slots}']:.2f}x")
    print(f"  multi-LoRA layer vs frozen base alone  {med[n] / med['base']:.2f}x")
    mm.destroy_parallel(destroy_process_group=True)


if __name__ == "__main__":
    main()

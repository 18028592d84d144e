"""Demo: train N adapters at once on a tiny frozen GPT under tensor parallelism (CPU).

    torchrun --standalone --nproc-per-node 2 scripts/train_demo.py [--steps 60]

Each adapter slot learns its own token mapping ``label = (a_k * token + b_k) mod vocab``
from the same frozen base. Every step packs one sequence per adapter into a single
micro-batch (adapter-major, block-diagonal causal attention), runs one forward/backward
through the multi-LoRA model and steps one AdamW optimizer per slot. Per-adapter losses fall
from ~ln(vocab) as each adapter learns its own task.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state

import megatron_multilora as mm

TASKS = [(1, 1), (3, 7), (5, 2), (7, 11), (9, 4), (11, 13), (13, 6), (15, 9)]  # (a_k, b_k)


def packed_batch(n: int, seq: int, vocab: int, gen: torch.Generator):
    """One sequence per adapter, concatenated; labels follow each adapter's own mapping."""
    tokens = torch.randint(0, vocab, (n, seq), generator=gen)
    labels = torch.stack([(a * tokens[k] + b) % vocab for k, (a, b) in enumerate(TASKS[:n])])
    segment = torch.arange(n).repeat_interleave(seq)
    pos = torch.arange(n * seq)
    # True = masked: causal and only within the adapter's own sequence.
    mask = (pos[None, :] > pos[:, None]) | (segment[None, :] != segment[:, None])
    return tokens.view(1, -1), labels.view(1, -1), mask.view(1, 1, n * seq, n * seq)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--adapters", type=int, default=4, choices=range(1, len(TASKS) + 1))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    # All processes form one tensor-parallel group.
    mm.init_parallel(tensor_model_parallel_size=int(os.environ.get("WORLD_SIZE", "1")), seed=1234)
    is_main = dist.get_rank() == 0
    cfg = mm.GPTModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                            num_query_groups=2, ffn_hidden_size=128, vocab_size=64)
    model = mm.build_gpt_model(cfg)
    mm.apply_multi_lora(model, n_adapters=args.adapters, dim=args.rank, alpha=2.0 * args.rank)
    optimizers = [torch.optim.AdamW(mm.slot_parameters(model, k), lr=args.lr, weight_decay=0.0)
                  for k in range(args.adapters)]
    if is_main:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        print(f"TP={parallel_state.get_tensor_model_parallel_world_size()}  "
              f"{args.adapters} adapters of rank {args.rank}  trainable/frozen params per rank: "
              f"{trainable:,}/{frozen:,}", flush=True)

    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, labels, mask = packed_batch(args.adapters, args.seq, cfg.vocab_size, gen)
        mm.set_tokens_per_adapter_slot(model, [args.seq] * args.adapters)
        token_loss = model(ids, torch.arange(ids.size(1))[None], mask, labels=labels)
        per_adapter = token_loss.view(args.adapters, args.seq).mean(dim=1)
        per_adapter.sum().backward()  # each adapter's gradient comes from its own loss only
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if is_main and (step == 1 or step % 10 == 0 or step == args.steps):
            losses = "  ".join(f"a{k}={v:.3f}" for k, v in enumerate(per_adapter.tolist()))
            print(f"step {step:4d}/{args.steps}  loss {losses}  "
                  f"({time.perf_counter() - start:.1f}s)", flush=True)
    table = cross_eval(model, args.adapters, args.seq, cfg.vocab_size)
    if is_main:
        print("held-out loss of adapter (row) on task (column); the diagonal should be lowest:")
        print("        " + "".join(f"  task{k}" for k in range(args.adapters)))
        for j, row in enumerate(table.tolist()):
            print(f"adapter{j}" + "".join(f"  {v:5.2f}" for v in row))
        wins = sum(int(table[:, k].argmin()) == k for k in range(args.adapters))
        print(f"adapters best on their own task: {wins}/{args.adapters}")
    mm.destroy_parallel(destroy_process_group=True)


@torch.no_grad()
def cross_eval(model: torch.nn.Module, n: int, seq: int, vocab: int) -> torch.Tensor:
    """[adapter, task] mean loss on fresh sequences: every task's tokens routed to one slot."""
    model.eval()
    ids, labels, mask = packed_batch(n, seq, vocab, torch.Generator().manual_seed(10_000))
    rows = []
    for j in range(n):
        mm.set_tokens_per_adapter_slot(model, [n * seq if k == j else 0 for k in range(n)])
        loss = model(ids, torch.arange(ids.size(1))[None], mask, labels=labels)
        rows.append(loss.view(n, seq).mean(dim=1))
    model.train()
    return torch.stack(rows)


if __name__ == "__main__":
    main()

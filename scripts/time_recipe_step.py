"""Median wall time of one recipe-style training step on a tiny model, for A/B runs across
commits (the tree on PYTHONPATH, run from its folder, is the one measured):

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python scripts/time_recipe_step.py tiny_dense
    git worktree add /tmp/old <commit> && (cd /tmp/old && PYTHONPATH=. OMP_NUM_THREADS=1 \
        <repo>/.venv/bin/python <repo>/scripts/time_recipe_step.py tiny_dense)

Alternate the trees a few times and compare medians (a shared machine is noisy). The step is
the recipe's: 4 slots (ranks 16/8/16/12, one with dropout 0.05), 16 random examples of 16-128
tokens per slot packed into 1024-token micro-batches, forward/backward, per-slot gradient
sync, grad norm and AdamW step (the recipe's ``SlotTrainStep``); 1 thread; 3 warm-up steps, then the median of 10. Prints one
JSON line.
"""

import json
import random
import statistics
import sys
import time

import torch
import yaml

import megatron_multilora as mm
from megatron_multilora.data.datasets import Example
from megatron_multilora.training.config import AdapterJob
from megatron_multilora.training.step.slot_optimizer import SlotOptimizer
from megatron_multilora.training.step.train_step import SlotTrainStep

SLOTS = [(16, 0.0), (8, 0.0), (16, 0.05), (12, 0.0)]  # (rank, dropout)


def main(kind: str) -> None:
    mm.support_megatron_here()
    torch.set_num_threads(1)
    mm.init_parallel(seed=0)
    torch.manual_seed(0)
    cfg = mm.GPTModelConfig(**yaml.safe_load(open(f"conf/model/{kind}.yaml")))
    model = mm.apply_multi_lora(mm.build_gpt_model(cfg, calculate_per_token_loss=True),
                                len(SLOTS), 16, 1.0)
    train_step = SlotTrainStep([model], len(SLOTS), token_budget=1024, pad_multiple=1, pad_id=0)
    optimizers = {}
    for slot, (rank, dropout) in enumerate(SLOTS):
        mm.init_adapter_slot(model, slot, rank, 2.0 * rank, dropout)
        optimizers[slot] = SlotOptimizer(mm.slot_parameters(model, slot),
                                         AdapterJob(name=f"job{slot}", dataset="-"), 100)
    rng = random.Random(0)
    times = []
    for i in range(13):
        slot_examples = [[Example(tuple(rng.randrange(3, 250) for _ in range(n + 1)), (True,) * n)
                          for n in (rng.randint(16, 128) for _ in range(16))] for _ in SLOTS]
        micro_batches = train_step.batcher.ready(slot_examples)
        start = time.perf_counter()
        train_step(slot_examples, optimizers, micro_batches=micro_batches)
        if i >= 3:
            times.append(time.perf_counter() - start)
    print(json.dumps({"model": kind, "micro_batches": len(micro_batches),
                      "median_step_ms": round(1e3 * statistics.median(times), 1)}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tiny_dense")

"""Median wall time of one recipe training step on a tiny model, for A/B runs across commits
(the tree on PYTHONPATH, run from its folder, is the one measured):

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.recipe_step tiny_dense
    git worktree add /tmp/old <commit> && (cd /tmp/old && PYTHONPATH=. OMP_NUM_THREADS=1 \
        <repo>/.venv/bin/python -m benchmarks.recipe_step tiny_dense)

Alternate the trees a few times and compare medians (a shared machine is noisy). The step is
the recipe's, built as its trainer builds it: the run composed from conf/ (``model=KIND``, no
HF base), its model (``build_run_model``), 4 jobs started in their slots by ``start_job``
(ranks 16/8/16/12, one with dropout 0.05), 16 random examples of 16-128 tokens per job packed
into 1024-token micro-batches, then ``SlotStep.train`` (forward/backward, per-slot gradient
sync, grad norm and AdamW step); 1 thread; 3 warm-up steps, then the median of 10. Prints one
JSON line.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

import torch

import megatron_multilora as mm
from benchmarks.workloads import recipe_run
from megatron_multilora.data.datasets import Example
from megatron_multilora.training.config import base_model_config
from megatron_multilora.training.model_setup import build_run_model
from megatron_multilora.training.runtime import start_job
from megatron_multilora.training.step.slot_step import SlotStep, slot_work

JOBS = [(16, 0.0), (8, 0.0), (16, 0.05), (12, 0.0)]  # (rank, dropout)


def run_overrides(kind: str) -> list[str]:
    jobs = ",".join(
        f"{{name:job{j},dataset:-,rank:{rank},alpha:{2 * rank},dropout:{dropout},max_steps:100}}"
        for j, (rank, dropout) in enumerate(JOBS)
    )
    return [
        f"model={kind}",
        "hf_dir=null",
        f"adapters=[{jobs}]",
        f"lora.slots={len(JOBS)}",
        "lora.max_rank=16",
        "trainer.micro_batch_tokens=1024",
        "seed=0",
    ]


def main(kind: str) -> None:
    mm.support_megatron_here()
    torch.set_num_threads(1)
    run = recipe_run(run_overrides(kind), check_files=False)
    mm.init_parallel(seed=run.seed)
    cfg = base_model_config(run)
    model = build_run_model(run, cfg)
    optimizers = {
        slot: start_job(model, slot, job, 100, cfg) for slot, job in enumerate(run.adapters)
    }
    train_step = SlotStep(
        model, run.lora.slots, run.trainer.micro_batch_tokens, pad_multiple=1, pad_id=0
    )
    rng = random.Random(0)
    times = []
    for i in range(13):
        slot_examples = [
            [
                Example(tuple(rng.randrange(3, 250) for _ in range(n + 1)), (True,) * n)
                for n in (rng.randint(16, 128) for _ in range(16))
            ]
            for _ in JOBS
        ]
        micro_batches = train_step.batcher.ready(slot_examples)
        start = time.perf_counter()
        train_step.train(slot_work(slot_examples, optimizers), micro_batches=micro_batches)
        if i >= 3:
            times.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "model": kind,
                "micro_batches": len(micro_batches),
                "median_step_ms": round(1e3 * statistics.median(times), 1),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tiny_dense")

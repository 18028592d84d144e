"""Rows 11: post-training objectives. 11a: four GRPO jobs' sampling in one batched
generation pass vs one job after another; 11b: one step of an SFT, a DPO and a GRPO job
together vs each job's step alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from benchmarks.report import Results, Row
from benchmarks.settings import Settings
from benchmarks.timing import Clock, medians, time_side_by_side
from benchmarks.workloads import build_model, model_config, random_examples, start_jobs
from megatron_multilora.data.datasets import Example
from megatron_multilora.training.objectives.dpo import DPO
from megatron_multilora.training.objectives.grpo import GRPO
from megatron_multilora.training.objectives.sft import SFT
from megatron_multilora.training.step.generation import generate
from megatron_multilora.training.step.sampling import KeyedSampler, RowSampling
from megatron_multilora.training.step.slot_step import SlotStep, slot_work

JOBS, PROMPTS, GROUP = 4, 4, 4  # GRPO jobs, prompts per rollout, samples per prompt


def sampling_variants(s: Settings, device: torch.device) -> dict[str, Callable[[], None]]:
    cfg = model_config("dense", s)
    model = build_model(cfg, s, JOBS).to(device)
    gen = torch.Generator().manual_seed(2)
    new = max(4, s.example_tokens // 2)
    prompts = [
        [
            (j, torch.randint(3, cfg.vocab_size, (s.example_tokens // 2,), generator=gen).tolist())
            for _ in range(PROMPTS * GROUP)
        ]
        for j in range(JOBS)
    ]
    rows = [[RowSampling(f"0:job{j}:0:{r}") for r in range(PROMPTS * GROUP)] for j in range(JOBS)]

    def sample(jobs: list[int]) -> None:
        # eos -1: no row stops early, so both ways generate the same number of tokens
        generate(
            model,
            [p for j in jobs for p in prompts[j]],
            JOBS,
            new,
            -1,
            1,
            0,
            pick=KeyedSampler([r for j in jobs for r in rows[j]]),
        )

    return {
        "one-pass": lambda: sample(list(range(JOBS))),
        "one-after-another": lambda: [sample([j]) for j in range(JOBS)],
    }


def _pair(example: Example) -> tuple[Example, Example]:
    n = len(example.loss_mask)
    values = {"ref_logprobs": (-5.0,) * n}
    return (
        dataclasses.replace(example, values={**values, "chosen": (1.0,) * n}, units=1),
        dataclasses.replace(example, values=values, units=0),
    )


def _rollout_row(example: Example, advantage: float) -> Example:
    n = len(example.loss_mask)
    return dataclasses.replace(
        example,
        values={
            "logprobs": (-5.0,) * n,
            "advantages": tuple(advantage * m for m in example.loss_mask),
            "weights": tuple(float(m) for m in example.loss_mask),
            "ref_logprobs": (-5.0,) * n,
        },
    )


def step_variants(s: Settings, device: torch.device) -> dict[str, Callable[[], None]]:
    cfg = model_config("dense", s)
    model = build_model(cfg, s, 3).to(device)
    gen = torch.Generator().manual_seed(3)
    n = s.examples_per_slot * 2
    sft = random_examples(n, s.example_tokens, cfg.vocab_size, gen)
    dpo = [_pair(e) for e in random_examples(n // 2, s.example_tokens, cfg.vocab_size, gen)]
    grpo = [
        _rollout_row(e, a)
        for e, a in zip(random_examples(n, s.example_tokens, cfg.vocab_size, gen), [1.0, -1.0] * n)
    ]
    slot_examples = [sft, dpo, grpo]
    objectives = {0: SFT(), 1: DPO(0.1, "sigmoid", 0.0), 2: GRPO(0.2, 0.2, 0.05)}
    step = SlotStep([model], 3, 4 * s.example_tokens * n, 1, 0)
    optimizers = start_jobs(model, s, cfg, 10**6, 3)
    batches = {"together": step.batcher.ready(slot_examples)}
    for slot in range(3):
        alone = [examples if k == slot else [] for k, examples in enumerate(slot_examples)]
        batches[slot] = step.batcher.ready(alone)

    def together() -> None:
        step.train(
            slot_work(slot_examples, optimizers, objectives), micro_batches=batches["together"]
        )

    def alone() -> None:
        for slot in range(3):
            step.train(
                slot_work(slot_examples, {slot: optimizers[slot]}, objectives),
                micro_batches=batches[slot],
            )

    return {"together": together, "each-alone": alone}


def section_post(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    clock.say(f"post-training: {JOBS} GRPO jobs' sampling in one pass vs one after another")
    out.samples["post-sampling"] = time_side_by_side(
        clock, "post-sampling", sampling_variants(s, device), s.job_rounds, 1
    )
    med = medians(out.samples["post-sampling"])
    row = Row(
        "11a",
        f"{JOBS} GRPO jobs' sampling: one batched pass vs one after another",
        (
            f"one rollout of {JOBS} GRPO jobs ({PROMPTS} prompts x {GROUP} samples each, "
            f"{s.example_tokens // 2}-token prompts, {max(4, s.example_tokens // 2)} new tokens, "
            "keyed top-p sampling, KV cache) on one model with a slot per job: every job's rows in "
            "one generation pass vs one pass per job"
        ),
        "one pass",
        "one after another",
        "s",
    ).fill(med["one-pass"], med["one-after-another"])
    row.note = f"Sampling together is {1 / row.ratio:.2f}x faster."
    out.rows.append(row)
    clock.say("post-training: an SFT, a DPO and a GRPO job's step together vs each alone")
    out.samples["post-step"] = time_side_by_side(
        clock, "post-step", step_variants(s, device), s.rounds, s.warmup
    )
    med = medians(out.samples["post-step"])
    row = Row(
        "11b",
        "mixed-objective step vs each job's step alone",
        (
            f"one optimizer step of an SFT job ({2 * s.examples_per_slot} examples), a DPO job "
            f"({s.examples_per_slot} pairs) and a GRPO job ({2 * s.examples_per_slot} sampled rows), "
            f"{s.example_tokens} tokens each: one packed forward/backward for the three vs three "
            "steps, one per job"
        ),
        "together",
        "each alone",
        "ms",
    ).fill(1e3 * med["together"], 1e3 * med["each-alone"])
    row.note = f"The mixed step is {1 / row.ratio:.2f}x faster than the three alone."
    out.rows.append(row)

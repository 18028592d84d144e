"""Rows 16: thousands of adapters on one base. What starting a job costs as the slots grow
(it touches its own slot only), and the trainer step on the same tokens spread over 1 to
1,024 slots (one example per slot at the most), in time and in aten ops. The ops are
counted as the GPU runs the step (the grouped GEMM one kernel, whose CPU fallback loops over
the groups; the stacked AdamW update, where the CPU runs torch's fused kernel per slot):
what a GPU's step launches.

    python -m benchmarks --only adapters
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from benchmarks.launches import count
from benchmarks.report import Results, Row
from benchmarks.settings import Settings
from benchmarks.timing import Clock, medians, time_side_by_side
from benchmarks.workloads import (
    build_model,
    model_config,
    random_examples,
    start_jobs,
    training_step,
)
from megatron_multilora.training.step.slot_adamw import SlotAdamW
from megatron_multilora.training.step.slot_step import slot_work

START_SLOTS = (64, 256, 1024)
STEP_SLOTS = (1, 64, 512, 1024)
STEP_EXAMPLES, STEP_TOKENS = 1024, 16  # in all, whatever the slot count


def start_costs(s: Settings, clock: Clock) -> dict[int, tuple[float, float]]:
    """Per slot count: (seconds of ``apply_multi_lora``, seconds per job start when every
    slot's job starts, as the trainer starts them)."""
    cfg, out = model_config("dense", s), {}
    for n in START_SLOTS:
        start = time.perf_counter()
        model = build_model(cfg, s, n)
        built = time.perf_counter() - start
        start = time.perf_counter()
        start_jobs(model, s, cfg, 10, n)
        out[n] = (built, (time.perf_counter() - start) / n)
        clock.say(f"adapters: {n} slots built in {built:.2f} s, {out[n][1] * 1e3:.1f} ms a start")
        del model
    return out


def step_variants(
    s: Settings, device: torch.device
) -> tuple[dict[str, Callable[[], None]], dict[str, SlotAdamW]]:
    """One trainer step of the dense GPT (rows 8's) on ``STEP_EXAMPLES`` examples spread
    over each slot count of ``STEP_SLOTS``, and each model's AdamW (to count the stacked
    update)."""
    cfg = model_config("dense", s)
    gen = torch.Generator().manual_seed(5)
    examples = random_examples(STEP_EXAMPLES, STEP_TOKENS, cfg.vocab_size, gen)
    variants, adamw = {}, {}
    for n in STEP_SLOTS:
        per = STEP_EXAMPLES // n
        slot_examples = [examples[i * per : (i + 1) * per] for i in range(n)]
        model = build_model(cfg, s, n)
        step, ((exs, mbs),) = training_step(model, n, [slot_examples], device)
        opts = start_jobs(model, s, cfg, 10**6, n)

        def run(step=step, exs=exs, mbs=mbs, opts=opts) -> None:
            step.train(slot_work(exs, opts), micro_batches=mbs)

        variants[f"{n} slots"] = run
        adamw[f"{n} slots"] = SlotAdamW.of(model)
    return variants, adamw


def section_adapters(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    starts = start_costs(s, clock)
    clock.say(f"adapters: trainer step over {STEP_SLOTS} slots: building")
    variants, adamw = step_variants(s, device)
    ops = {}
    for name, fn in variants.items():
        stacked, adamw[name].stacked = adamw[name].stacked, True
        ops[name] = count(fn).ops
        adamw[name].stacked = stacked
    rounds = min(s.rounds, 3)
    out.samples["adapters"] = time_side_by_side(clock, "adapters", variants, rounds, 1)
    med = medians(out.samples["adapters"])
    out.rows += adapter_rows(starts, med, ops)


def adapter_rows(
    starts: dict[int, tuple[float, float]], med: dict[str, float], ops: dict[str, int]
) -> list[Row]:
    low, high = START_SLOTS[0], START_SLOTS[-1]
    rows = [
        Row(
            "16a",
            f"starting one job: {high} slots vs {low}",
            "a job's start as the trainer makes it (fresh weights seeded by its name, rank and "
            "alpha bound, its optimizer) with every slot's job started in turn, dense GPT of "
            "rows 8; ms per start",
            f"{high} slots",
            f"{low} slots",
            "ms",
            note=(
                "apply_multi_lora: "
                + ", ".join(f"{n} slots {b:.2f} s" for n, (b, _) in starts.items())
                + "; per start: "
                + ", ".join(f"{n} slots {p * 1e3:.1f} ms" for n, (_, p) in starts.items())
            ),
        ).fill(starts[high][1] * 1e3, starts[low][1] * 1e3)
    ]
    tokens = STEP_EXAMPLES * (STEP_TOKENS - 1)
    for suffix, n in zip("bcd", STEP_SLOTS[1:]):
        rows.append(
            Row(
                f"16{suffix}",
                f"trainer step: {n} slots vs 1, same tokens",
                f"one SlotStep.train of the dense GPT of rows 8, {STEP_EXAMPLES} examples "
                f"({tokens} positions) over {n} slots ({STEP_EXAMPLES // n} each) vs all in one",
                f"{n} slots",
                "1 slot",
                "ms",
                note=(
                    f"aten ops as a GPU runs the step: {ops[f'{n} slots']} vs {ops['1 slots']} "
                    f"({ops[f'{n} slots'] / ops['1 slots']:.2f}x)"
                ),
            ).fill(med[f"{n} slots"] * 1e3, med["1 slots"] * 1e3)
        )
    return rows

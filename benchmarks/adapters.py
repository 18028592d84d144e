"""Rows 16: thousands of adapters on one base. What starting a job costs as the slots grow
(it touches its own slot only), the trainer step on the same tokens spread over 1 to 1,024
slots (one example per slot at the most), in time and in aten ops, and what paging one
adapter between its device slot and host memory costs at SmolLM2-135M's shapes, and the
training service with 64 tenants over 8 device slots vs 8 tenants (``api_paging``). The ops are
counted as the GPU runs the step (the grouped GEMM one kernel, whose CPU fallback loops over
the groups; the stacked AdamW update, where the CPU runs torch's fused kernel per slot):
what a GPU's step launches.

    python -m benchmarks --only adapters
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

import megatron_multilora as mm
from benchmarks.api_paging import service_paging, service_paging_rows
from benchmarks.launches import count
from benchmarks.report import Results, Row
from benchmarks.scaling import SMOLLM2_135M
from benchmarks.settings import Settings
from benchmarks.timing import Clock, medians, time_side_by_side
from benchmarks.workloads import (
    build_model,
    make_job,
    model_config,
    random_examples,
    start_jobs,
    training_step,
)
from megatron_multilora.training.runtime import start_job
from megatron_multilora.training.step.adapter_table import AdapterTable
from megatron_multilora.training.step.slot_adamw import SlotAdamW
from megatron_multilora.training.step.slot_step import SlotStep, slot_work

START_SLOTS = (64, 256, 1024)
STEP_SLOTS = (1, 64, 512, 1024)
STEP_EXAMPLES, STEP_TOKENS = 1024, 16  # in all, whatever the slot count
# 4,096 slots, one example each, against one slot on the same 4,096 examples: rank 8 (the
# slots' own state is then 6.5 GiB), one timed round (a CPU step takes minutes).
BIG_SLOTS, BIG_RANK = 4096, 8
PAGE_RANKS, PAGE_SLOTS = (8, 64), 4  # the main job's rank, and a large one


def paging_costs(s: Settings, clock: Clock) -> dict[int, tuple[float, float, int]]:
    """Per rank of ``PAGE_RANKS``: (ms to page one adapter out, ms to page it back in, its
    page's bytes): a SmolLM2-135M-shaped GPT (30 layers) with rank-``rank`` slots on
    qkv/proj/fc1/fc2, medians over the rounds; the adapter's weights and AdamW moments
    (fp32), as the trainer pages a job between turns."""
    cfg, out = mm.GPTModelConfig(num_layers=30, **SMOLLM2_135M), {}
    for rank in PAGE_RANKS:
        sr = dataclasses.replace(s, rank=rank)
        model = build_model(cfg, sr, PAGE_SLOTS)
        table = AdapterTable(SlotStep([model], PAGE_SLOTS, 64, 1, 0))
        for j in range(PAGE_SLOTS):
            slot = table.place([j])[j]
            table.bind(j, start_job(model, slot, make_job(j, sr), 10, cfg))
        outs, ins = [], []
        for r in range(max(3, s.rounds)):
            key = r % PAGE_SLOTS
            start = time.perf_counter()
            table.page_out(key)
            middle = time.perf_counter()
            table.place([key])
            outs.append(middle - start)
            ins.append(time.perf_counter() - middle)
        nbytes = table.stats.bytes_out // table.stats.pages_out
        out[rank] = (statistics.median(outs) * 1e3, statistics.median(ins) * 1e3, nbytes)
        clock.say(
            f"adapters: paging a rank-{rank} SmolLM2-135M adapter ({nbytes / 2**20:.1f} MiB): "
            f"out {out[rank][0]:.1f} ms, in {out[rank][1]:.1f} ms"
        )
        del model, table
    return out


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
    s: Settings,
    device: torch.device,
    slot_counts: tuple[int, ...] = STEP_SLOTS,
    n_examples: int = STEP_EXAMPLES,
) -> tuple[dict[str, Callable[[], None]], dict[str, SlotAdamW]]:
    """One trainer step of the dense GPT (rows 8's) on ``n_examples`` examples spread over
    each slot count of ``slot_counts`` (stepped once: its gradients and optimizer state
    exist), and each model's AdamW (to count the stacked update and the slots' own bytes)."""
    cfg = model_config("dense", s)
    gen = torch.Generator().manual_seed(5)
    examples = random_examples(n_examples, STEP_TOKENS, cfg.vocab_size, gen)
    variants, adamw = {}, {}
    for n in slot_counts:
        per = n_examples // n
        slot_examples = [examples[i * per : (i + 1) * per] for i in range(n)]
        model = build_model(cfg, s, n)
        step, ((exs, mbs),) = training_step(model, n, [slot_examples], device)
        opts = start_jobs(model, s, cfg, 10**6, n)

        def run(step=step, exs=exs, mbs=mbs, opts=opts) -> None:
            step.train(slot_work(exs, opts), micro_batches=mbs)

        run()  # the gradients and the optimizer state exist after a first step
        variants[f"{n} slots"] = run
        adamw[f"{n} slots"] = SlotAdamW.of(model)
    return variants, adamw


def big_step(s: Settings, device: torch.device, clock: Clock) -> dict:
    """Row 16e: ``BIG_SLOTS`` slots, one example each, vs one slot on the same examples:
    two timed rounds each and the slots' own bytes. Its aten ops are not counted: the
    profiler's event tree of a 4,096-slot step outgrew this machine's 24 GiB (rows 16b-16d
    count them up to 1,024 slots)."""
    sb = dataclasses.replace(s, rank=BIG_RANK)
    clock.say(f"adapters: the step at {BIG_SLOTS} slots vs 1 on {BIG_SLOTS} examples: building")
    variants, adamw = step_variants(sb, device, (1, BIG_SLOTS), BIG_SLOTS)
    own = {name: adapter_bytes(a) for name, a in adamw.items()}
    samples = time_side_by_side(clock, "adapters big", variants, 2, 0)
    return {"samples": samples, "own": own}


def adapter_bytes(adamw: SlotAdamW) -> float:
    """The bytes the slots' own state takes: parameters, gradients, masters (when apart)
    and both moments, every slot."""
    rows = adamw.rows
    values = list(rows.values.values())
    tensors = [*values, *rows.grads.values()]
    tensors += [m for m in adamw.masters.values() if all(m is not v for v in values)]
    tensors += [t for moment in adamw.moments.values() for t in moment.values()]
    return float(sum(t.numel() * t.element_size() for t in tensors))


def section_adapters(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    starts = start_costs(s, clock)
    pages = paging_costs(s, clock)
    big = big_step(s, device, clock)
    clock.say(f"adapters: trainer step over {STEP_SLOTS} slots: building")
    variants, adamw = step_variants(s, device)
    own = {name: adapter_bytes(a) for name, a in adamw.items()}
    ops = {}
    for name, fn in variants.items():
        stacked, adamw[name].stacked = adamw[name].stacked, True
        ops[name] = count(fn).ops
        adamw[name].stacked = stacked
    rounds = min(s.rounds, 3)
    out.samples["adapters"] = time_side_by_side(clock, "adapters", variants, rounds, 1)
    med = medians(out.samples["adapters"])
    service = {} if device.type != "cpu" else service_paging(s, clock)
    out.samples["adapters-service"] = service.pop("samples", {})
    out.samples["adapters-big"] = big["samples"]
    out.rows += adapter_rows(starts, med, ops, own) + [big_row(big)] + paging_rows(pages)
    out.rows += service_paging_rows(s, service) if service else []


def big_row(big: dict) -> Row:
    med, own = medians(big["samples"]), big["own"]
    many = f"{BIG_SLOTS} slots"
    return Row(
        "16e",
        f"trainer step: {BIG_SLOTS} slots vs 1, same tokens",
        f"one SlotStep.train of the dense GPT of rows 8, rank {BIG_RANK}, {BIG_SLOTS} examples "
        f"({BIG_SLOTS * (STEP_TOKENS - 1)} positions) over {BIG_SLOTS} slots (one each) vs all "
        "in one; two rounds",
        many,
        "1 slot",
        "ms",
        note=(
            f"the slots' own state (weights, gradients, moments): {own[many] / 2**30:.2f} GiB "
            f"vs {own['1 slots'] / 2**20:.2f} MiB, the rest of the step's memory the same "
            "for both; aten ops not counted (the profiler's event tree outgrew 24 GiB)"
        ),
    ).fill(med[many] * 1e3, med["1 slots"] * 1e3)


def paging_rows(pages: dict[int, tuple[float, float, int]]) -> list[Row]:
    rows = []
    for suffix, (rank, (out_ms, in_ms, nbytes)) in zip("fg", pages.items()):
        seconds = (out_ms + in_ms) / 1e3
        rows.append(
            Row(
                f"16{suffix}",
                f"paging one adapter, SmolLM2-135M, rank {rank}: in vs out",
                "one job's adapter (weights and both AdamW moments, fp32; 30 layers, "
                "qkv/proj/fc1/fc2) from its device slot to host memory and back, as the trainer "
                "pages a job between turns",
                "in",
                "out",
                "ms",
                note=(
                    f"{nbytes / 2**20:.1f} MiB a page; {2 * nbytes / seconds / 1e9:.1f} GB/s "
                    "out and in together"
                ),
            ).fill(in_ms, out_ms)
        )
    return rows


def adapter_rows(
    starts: dict[int, tuple[float, float]],
    med: dict[str, float],
    ops: dict[str, int],
    own: dict[str, float],
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
                    f"({ops[f'{n} slots'] / ops['1 slots']:.2f}x); the slots' own state "
                    f"(weights, gradients, moments): {own[f'{n} slots'] / 2**20:.0f} MiB vs "
                    f"{own['1 slots'] / 2**20:.2f} MiB"
                ),
            ).fill(med[f"{n} slots"] * 1e3, med["1 slots"] * 1e3)
        )
    return rows

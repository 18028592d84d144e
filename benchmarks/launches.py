"""Rows L: aten ops and host reads per step, counted (not timed) under ``torch.profiler``.

On a GPU each aten op that computes is a kernel launch and each host read of a tensor's value
(``.item()``, ``.tolist()``, ``bool(t)``) an ``aten::_local_scalar_dense``, a device sync; a
step that is bound by its host grows with them. Counting them needs no GPU and gives the same
figures on any machine, so ``tests/unit/test_launches.py`` holds the line with them. The
optimizer is counted as the GPU runs it (one stacked update; the CPU, bound by memory rather
than launches, runs torch's fused kernel per slot: ``training/step/slot_adamw.py``).

    python -m benchmarks --only launches
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

import megatron_multilora as mm
from benchmarks.report import Results, Row
from benchmarks.scaling import SCALE_EXAMPLES, SMOLLM2_135M, scaling_variants
from benchmarks.settings import Settings
from benchmarks.timing import Clock
from benchmarks.workloads import (
    build_model,
    pack_one,
    random_examples,
    timed_model_step,
)
from megatron_multilora.training.step.slot_adamw import SlotAdamW

HOST_READ = "aten::_local_scalar_dense"
# On CPU torch's grouped GEMM is a loop of per-group GEMMs that reads each group's end to the
# host; on the GPU it is one kernel that reads them on the device. Its insides are not counted.
ONE_KERNEL = "aten::_grouped_mm"

STEP_SLOTS = (1, 8, 64)
WIDTH_LAYERS, WIDTH_SLOTS, WIDTH_RANK = 4, 4, 16


@dataclasses.dataclass(frozen=True)
class Count:
    ops: int
    host_reads: int


def count(fn: Callable[[], None], warmup: int = 1) -> Count:
    """aten ops (every one the profiler records, nested ones too) and host reads of one call
    of ``fn``, after ``warmup`` calls (first-call set-up is not a step's cost)."""
    for _ in range(warmup):
        fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name for e in prof.events() if e.name.startswith("aten::") and not _inside(e)]
    return Count(len(names), names.count(HOST_READ))


def _inside(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == ONE_KERNEL:
            return True
        parent = parent.cpu_parent
    return False


def trainer_steps(s: Settings, slots: tuple[int, ...] = STEP_SLOTS) -> dict[int, Callable]:
    """Rows 8's trainer step (the same ``SCALE_EXAMPLES`` examples over each slot count) with
    the GPU's stacked AdamW update, which the CPU can run too."""
    variants = scaling_variants(s, torch.device("cpu"), slots, stacked=True)
    return {n: variants[f"{n} slots"] for n in slots}


def width_steps(s: Settings, tokens: int = 64) -> dict[str, Callable]:
    """fwd+bwd of a SmolLM2-135M-shaped GPT of ``WIDTH_LAYERS`` layers: the frozen base, and
    ``WIDTH_SLOTS`` rank-16 slots on qkv/proj/fc1/fc2 (one example each), their parameters and
    gradients held as the trainer's step holds them."""
    cfg = mm.GPTModelConfig(num_layers=WIDTH_LAYERS, **SMOLLM2_135M)
    sw = dataclasses.replace(s, rank=WIDTH_RANK)
    gen = torch.Generator().manual_seed(3)
    per_slot = [
        random_examples(1, tokens // WIDTH_SLOTS, cfg.vocab_size, gen) for _ in range(WIDTH_SLOTS)
    ]
    mb = pack_one(per_slot, torch.device("cpu"))
    base, multi = build_model(cfg, sw, None), build_model(cfg, sw, WIDTH_SLOTS)
    SlotAdamW.of(multi)  # as the trainer's step holds it: gradients go to the slots' rows
    return {"base": timed_model_step(base, mb), "lora": timed_model_step(multi, mb)}


def section_launches(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    steps = {f"{n} slots": fn for n, fn in trainer_steps(s).items()}
    counts = {}
    for name, fn in steps.items():
        counts[name] = count(fn)
        clock.say(f"launches: trainer step, {name}: {counts[name]}")
    for name, fn in width_steps(s).items():
        counts[name] = count(fn)
        clock.say(f"launches: SmolLM2-shaped fwd+bwd, {name}: {counts[name]}")
    out.rows += launch_rows(counts)


def launch_rows(c: dict[str, Count]) -> list[Row]:
    step = (
        f"one SlotStep.train of the dense GPT of rows 8, {SCALE_EXAMPLES} examples over {{}} vs "
        "all in 1 slot"
    )
    width = (
        f"forward+backward of a {WIDTH_LAYERS}-layer GPT of SmolLM2-135M's width with "
        f"{WIDTH_SLOTS} rank-{WIDTH_RANK} slots on qkv/proj/fc1/fc2 vs the frozen base"
    )
    specs = [
        ("14a", "trainer step aten ops: 8 slots vs 1", step, "8 slots", "1 slots", "ops"),
        ("14b", "trainer step aten ops: 64 slots vs 1", step, "64 slots", "1 slots", "ops"),
        (
            "14c",
            "trainer step host reads: 64 slots vs 1",
            step,
            "64 slots",
            "1 slots",
            "host_reads",
        ),
        ("14d", "SmolLM2-shaped fwd+bwd aten ops: 4 slots vs base", width, "lora", "base", "ops"),
        ("14e", "SmolLM2-shaped fwd+bwd host reads", width, "lora", "base", "host_reads"),
    ]
    unit = {"ops": "aten ops", "host_reads": "host reads"}
    return [
        Row(id_, title, f"{what.format(a)} (counted under torch.profiler)", a, b, unit[get]).fill(
            getattr(c[a], get), getattr(c[b], get)
        )
        for id_, title, what, a, b, get in specs
    ]

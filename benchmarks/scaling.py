"""Rows 8 and 9: how the trainer step scales with the number of slots, and the multi-LoRA overhead
at a real model's width (SmolLM2-135M's geometry)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

import megatron_multilora as mm
from benchmarks.report import Results, Row
from benchmarks.settings import Settings
from benchmarks.timing import Clock, medians, time_side_by_side
from benchmarks.workloads import (
    build_model,
    model_config,
    pack_one,
    random_examples,
    start_jobs,
    timed_model_step,
    training_step,
)
from megatron_multilora.training.step.slot_adamw import SlotAdamW
from megatron_multilora.training.step.slot_step import slot_work

SCALE_SLOTS = (1, 8, 32, 64)


SCALE_EXAMPLES = 64  # in all, whatever the slot count: one per slot at 64 slots


SMOLLM2_135M = dict(
    hidden_size=576,
    num_attention_heads=9,
    num_query_groups=3,
    ffn_hidden_size=1536,
    vocab_size=49152,
    max_sequence_length=2048,
    rotary_base=100000,
    tie_word_embeddings=True,
    normalization="RMSNorm",
    activation="silu",
    gated_linear_unit=True,
    position_embedding_type="rope",
)


SMOLLM2_LAYERS = 30


WIDTH_SLOTS, WIDTH_RANK = 4, 16


def scaling_variants(
    s: Settings,
    device: torch.device,
    slot_counts: tuple[int, ...] = SCALE_SLOTS,
    stacked: bool | None = None,
    cuda_graphs: bool = False,
) -> dict[str, Callable[[], None]]:
    """One trainer step (SlotStep.train: forward/backward of one packed micro-batch, per-slot
    grad norms, every slot's AdamW step) of the dense GPT of rows 1c/2c, the same
    ``SCALE_EXAMPLES`` examples spread over N slots (64 / N each), for each N of
    ``slot_counts``; ``stacked`` picks the AdamW update (default: the device's);
    ``cuda_graphs``: the pass replayed from CUDA graphs."""
    cfg = model_config("dense", s)
    gen = torch.Generator().manual_seed(2)
    examples = random_examples(SCALE_EXAMPLES, s.example_tokens, cfg.vocab_size, gen)
    variants = {}
    for n in slot_counts:
        per = SCALE_EXAMPLES // n
        slot_examples = [examples[i * per : (i + 1) * per] for i in range(n)]
        model = build_model(cfg, s, n)
        if stacked is not None:
            SlotAdamW.of(model).stacked = stacked
        step, ((exs, mbs),) = training_step(model, n, [slot_examples], device, cuda_graphs)
        opts = start_jobs(model, s, cfg, 10**6, n)

        def run(step=step, exs=exs, mbs=mbs, opts=opts) -> None:
            step.train(slot_work(exs, opts), micro_batches=mbs)

        variants[f"{n} slots"] = run
    return variants


def scaling_rows(s: Settings, med: dict[str, float]) -> list[Row]:
    tokens = SCALE_EXAMPLES * (s.example_tokens - 1)
    rows = []
    for suffix, n in zip("abc", SCALE_SLOTS[1:]):
        row = Row(
            f"8{suffix}",
            f"trainer step: {n} slots vs 1 slot, same tokens",
            (
                f"one trainer step (SlotStep.train: forward/backward of one packed micro-batch "
                f"through megatron's schedule, per-slot grad norms and clipping, each slot's AdamW "
                f"step; packing done beforehand) of the dense GPT of rows 1c/2c, {SCALE_EXAMPLES} "
                f"examples ({tokens} positions) spread over {n} slots ({SCALE_EXAMPLES // n} each) "
                f"vs all in 1 slot; rank {s.rank}"
            ),
            f"{n} slots",
            "1 slot",
            "ms",
        )
        row.fill(med[f"{n} slots"] * 1e3, med["1 slots"] * 1e3)
        rows.append(row)
    rows[-1].note = (
        "Medians per slot count: "
        + ", ".join(f"{n} slots {med[f'{n} slots'] * 1e3:.1f} ms" for n in SCALE_SLOTS)
        + "."
    )
    return rows


def width_config(s: Settings) -> mm.GPTModelConfig:
    return mm.GPTModelConfig(num_layers=s.width_layers, **SMOLLM2_135M)


def width_variants(s: Settings, device: torch.device) -> dict[str, Callable[[], None]]:
    """fwd+bwd of the SmolLM2-135M-shaped GPT with ``WIDTH_SLOTS`` rank-16 slots on every
    linear vs the frozen base alone, the same ``width_tokens`` tokens (one example per slot)."""
    cfg = width_config(s)
    sw = dataclasses.replace(s, rank=WIDTH_RANK)
    gen = torch.Generator().manual_seed(3)
    per_slot = [
        random_examples(1, s.width_tokens // WIDTH_SLOTS, cfg.vocab_size, gen)
        for _ in range(WIDTH_SLOTS)
    ]
    mb = pack_one(per_slot, device)
    base, multi = build_model(cfg, sw, None), build_model(cfg, sw, WIDTH_SLOTS)
    return {"base": timed_model_step(base, mb), f"lora-{WIDTH_SLOTS}": timed_model_step(multi, mb)}


def width_row(s: Settings, med: dict[str, float]) -> Row:
    layers = (
        f"all {SMOLLM2_LAYERS} layers"
        if s.width_layers == SMOLLM2_LAYERS
        else f"{s.width_layers} of its {SMOLLM2_LAYERS} layers (same width)"
    )
    return Row(
        "9",
        "real width (SmolLM2-135M shape): multi-LoRA vs frozen base",
        (
            f"forward+backward of a GPT with SmolLM2-135M's geometry (hidden 576, 9 heads, 3 KV "
            f"groups, FFN 1536, vocab 49152, tied embeddings; {layers}; random weights, no "
            f"download) over {s.width_tokens} tokens ({WIDTH_SLOTS} examples of "
            f"{s.width_tokens // WIDTH_SLOTS}): {WIDTH_SLOTS} slots of rank {WIDTH_RANK} on every "
            f"linear (qkv, proj, fc1, fc2), one example each, vs the frozen base alone (embedding "
            f"output requiring grad, as rows 2); {s.width_rounds} rounds"
        ),
        f"{WIDTH_SLOTS} slots",
        "base",
        "ms",
    ).fill(med[f"lora-{WIDTH_SLOTS}"] * 1e3, med["base"] * 1e3)


def section_scaling(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    clock.say(f"scaling: trainer step with {SCALE_SLOTS} slots: building")
    out.samples["scaling"] = time_side_by_side(
        clock, "scaling", scaling_variants(s, device), s.rounds, s.warmup
    )
    out.rows += scaling_rows(s, medians(out.samples["scaling"]))


def section_width(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    clock.say(f"width: SmolLM2-135M shape, {s.width_layers} layers: building")
    out.samples["width"] = time_side_by_side(
        clock, "width", width_variants(s, device), s.width_rounds, max(1, s.warmup)
    )
    out.rows += [width_row(s, medians(out.samples["width"]))]

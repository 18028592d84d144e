"""Rows 15 (GPU only): rows 1c, 8a-8c and 9 eager and with the training pass replayed from
CUDA graphs (``trainer.cuda_graphs``), every variant timed side by side in one run, so that
one call on a lent GPU gives every figure (``scripts/gpu_check.sh``, stage bench-graphs).

Goals on the GPU (issue 50): row 9 at most 1.25x the frozen base, row 8c at most 1.3x, row
1c at most 1.05x.

    python -m benchmarks --device cuda --only graphs
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.layers_and_models import model_variants
from benchmarks.report import Results, Row
from benchmarks.scaling import SCALE_SLOTS, WIDTH_SLOTS, scaling_variants, width_variants
from benchmarks.settings import Settings
from benchmarks.timing import Clock, medians, time_side_by_side
from megatron_multilora.layers.lifecycle import model_chunks
from megatron_multilora.training.step.cuda_graphs import ChunkGraphs, graph_lengths
from megatron_multilora.training.step.micro_batches import MicroBatch, pad_micro_batch
from megatron_multilora.training.step.schedule import per_slot_results_and_data
from megatron_multilora.training.step.slot_adamw import SlotAdamW


def graphed_model_step(model: torch.nn.Module, mb: MicroBatch) -> Callable[[], None]:
    """What a model row times (forward+backward of ``mb``, each slot's loss over its own
    tokens), the pass replayed from CUDA graphs: ``mb`` padded to its graph length."""
    rows = SlotAdamW.of(model).rows
    graphs = ChunkGraphs(model_chunks(model)[0], rows)
    length = next(n for n in graph_lengths(mb.tokens.size(1)) if n >= mb.tokens.size(1))
    host = pad_micro_batch(mb.to(torch.device("cpu")), length, 0)

    def step() -> None:
        rows.grad_buffer.zero_()
        per_slot_results_and_data(model, [host], host.loss_units_per_slot(), keep=(), graphs=graphs)

    return step


def graph_variants(s: Settings, device: torch.device) -> dict[str, Callable[[], None]]:
    """Rows 1c, 8 and 9's variants, each eager and graphed."""
    out: dict[str, Callable[[], None]] = {}
    for graphs in (False, True):
        tag = "graphs" if graphs else "eager"
        for name, fn in scaling_variants(s, device, cuda_graphs=graphs).items():
            out[f"8 {name} {tag}"] = fn
    dense = model_variants("dense", s, device)
    out["1c lora-1 eager"], out[f"1c lora-{s.slots} eager"] = (
        dense["lora-1"],
        dense[f"lora-{s.slots}"],
    )
    width = width_variants(s, device)
    out["9 base eager"], out["9 lora eager"] = width["base"], width[f"lora-{WIDTH_SLOTS}"]
    for key, timed in (
        ("1c lora-1", dense["lora-1"]),
        (f"1c lora-{s.slots}", dense[f"lora-{s.slots}"]),
        ("9 lora", width[f"lora-{WIDTH_SLOTS}"]),
    ):
        out[f"{key} graphs"] = graphed_model_step(timed.model, timed.mb)
    return out


def graph_rows(s: Settings, med: dict[str, float]) -> list[Row]:
    ms = {k: v * 1e3 for k, v in med.items()}
    rows = []
    for tag in ("eager", "graphs"):
        rows.append(
            Row(
                f"15-1c-{tag}",
                f"row 1c {tag}: dense GPT, {s.slots} slots vs 1 slot",
                f"row 1c's model step ({tag}; graphs pad the micro-batch to its graph length)",
                f"{s.slots} slots",
                "1 slot",
                "ms",
            ).fill(ms[f"1c lora-{s.slots} {tag}"], ms[f"1c lora-1 {tag}"])
        )
        for suffix, n in zip("abc", SCALE_SLOTS[1:]):
            rows.append(
                Row(
                    f"15-8{suffix}-{tag}",
                    f"row 8{suffix} {tag}: trainer step, {n} slots vs 1 slot",
                    f"row 8{suffix}'s trainer step ({tag})",
                    f"{n} slots",
                    "1 slot",
                    "ms",
                ).fill(ms[f"8 {n} slots {tag}"], ms[f"8 1 slots {tag}"])
            )
        rows.append(
            Row(
                f"15-9-{tag}",
                f"row 9 {tag}: SmolLM2-135M shape, {WIDTH_SLOTS} slots vs the frozen base (eager)",
                f"row 9's forward+backward with {WIDTH_SLOTS} slots ({tag}) vs the base, eager",
                f"{WIDTH_SLOTS} slots",
                "base",
                "ms",
            ).fill(ms[f"9 lora {tag}"], ms["9 base eager"])
        )
    for key, title in (
        ("8 64 slots", "trainer step, 64 slots"),
        (f"1c lora-{s.slots}", f"dense GPT model step, {s.slots} slots"),
        ("9 lora", f"SmolLM2-135M shape, {WIDTH_SLOTS} slots"),
    ):
        rows.append(
            Row(
                f"15-speedup-{key.split()[0]}",
                f"{title}: CUDA graphs vs eager",
                "the same work replayed from CUDA graphs vs eager",
                "graphs",
                "eager",
                "ms",
            ).fill(ms[f"{key} graphs"], ms[f"{key} eager"])
        )
    return rows


def section_graphs(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    if device.type != "cuda":
        raise ValueError("the graphs section times CUDA graphs: run it with --device cuda")
    clock.say("graphs: rows 1c, 8 and 9, eager and CUDA graphs: building")
    out.samples["graphs"] = time_side_by_side(
        clock, "graphs", graph_variants(s, device), s.rounds, max(1, s.warmup)
    )
    out.rows += graph_rows(s, medians(out.samples["graphs"]))

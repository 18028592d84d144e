"""Rows 6: the fully sharded (S-LoRA) vs the default adapter layout under TP=2."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import megatron_multilora as mm
from benchmarks.children import torchrun_two
from benchmarks.report import Results, Row
from benchmarks.settings import Settings
from benchmarks.timing import Clock, medians, time_side_by_side
from benchmarks.workloads import (
    build_model,
    model_config,
    slot_and_single_batches,
    timed_model_step,
)
from megatron_multilora.models.specs import transformer_engine_usable


def tp_worker(s: Settings, result_file: str) -> None:
    """Run under torchrun with 2 processes: time the dense model's step with the default vs
    the fully sharded adapter layout, without and with sequence parallelism."""
    device = torch.device(s.device)
    mm.init_parallel(tensor_model_parallel_size=2, sequence_parallel=False, seed=0)
    clock = Clock(device)
    cfg = model_config("dense", s)
    batch, _ = slot_and_single_batches(s, cfg.vocab_size, device, pad_multiple=2)
    groups = {}
    for sp in (False, True):
        models = {
            layout: build_model(
                cfg, s, s.slots, sequence_parallel=sp, fully_sharded=layout == "fully-sharded"
            )
            for layout in ("fully-sharded", "default")
        }
        groups[f"sp={sp}"] = time_side_by_side(
            clock,
            f"TP=2{' +SP' if sp else ''}",
            {k: timed_model_step(m, batch) for k, m in models.items()},
            s.rounds,
            s.warmup,
        )
    if torch.distributed.get_rank() == 0:  # ranks time the same lockstep steps
        Path(result_file).write_text(json.dumps(groups))
    mm.destroy_parallel(destroy_process_group=True)


def run_tp(s: Settings, clock: Clock) -> tuple[dict | None, str | None]:
    """The TP groups from a 2-process torchrun of this script, or why they were skipped."""
    if s.skip_tp:
        return None, "skipped: --skip-tp"
    if s.device == "cuda" and torch.cuda.device_count() < 2:
        return None, f"skipped: TP=2 needs 2 GPUs, found {torch.cuda.device_count()}"
    if s.device == "cuda" and transformer_engine_usable():
        return None, (
            "skipped: fully_sharded needs megatron's own parallel linears, and "
            "build_gpt_model uses Transformer Engine's here"
        )
    return torchrun_two(s, clock, "--tp-worker", "TP=2")


def tp_rows(s: Settings, groups: dict | None, skipped: str | None) -> list[Row]:
    rows = []
    for suffix, sp in (("a", False), ("b", True)):
        row = Row(
            f"6{suffix}",
            f"TP=2{' + SP' if sp else ''}: fully sharded vs default",
            (
                f"dense model step with {s.slots} slots on 2 tensor-parallel processes"
                f"{' (1 thread each)' if s.device == 'cpu' else ''}"
                f"{' with sequence parallelism' if sp else ''}: fully sharded (S-LoRA) adapter layout "
                "vs the default one (replicated A or B)"
            ),
            "fully sharded",
            "default",
            "ms",
        )
        if groups is None:
            row.skipped = skipped
        else:
            med = medians(groups[f"sp={sp}"])
            row.fill(med["fully-sharded"] * 1e3, med["default"] * 1e3)
        rows.append(row)
    return rows


def section_tp(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    tp_groups, tp_skipped = run_tp(s, clock)
    if tp_groups:
        out.samples.update({f"TP=2 {k}": v for k, v in tp_groups.items()})
    out.rows += tp_rows(s, tp_groups, tp_skipped)

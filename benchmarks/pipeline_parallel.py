"""Rows 7: one trainer step on two pipeline stages vs two data-parallel ranks and vs one process."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import torch

import megatron_multilora as mm
from benchmarks.children import torchrun_two
from benchmarks.report import Results, Row
from benchmarks.settings import Settings
from benchmarks.timing import Clock, medians
from benchmarks.workloads import build_model, model_config, random_examples, start_jobs
from megatron_multilora.data.datasets import Example
from megatron_multilora.training.step.slot_step import SlotStep, StepResult, slot_work

PP_LAYOUTS = {"PP=2": 2, "DP=2": 1}  # the 2-process layouts: name -> pipeline size


PP_ROUNDS_PER_BLOCK = 3


def pp_model_config(s: Settings) -> mm.GPTModelConfig:
    """The dense model of rows 1c-2c, one layer more if needed to split into 2 stages."""
    cfg = model_config("dense", s)
    return dataclasses.replace(cfg, num_layers=cfg.num_layers + cfg.num_layers % 2)


def pp_examples_per_slot(s: Settings) -> int:
    """``examples_per_slot`` rounded up to even: each DP=2 rank gets half of every slot's."""
    return s.examples_per_slot + s.examples_per_slot % 2


def pp_data(s: Settings, vocab: int) -> tuple[list[list[Example]], int]:
    """One step's global batch (every slot's examples, all of one length) and the token
    budget that packs it into ``pp_micro_batches`` micro-batches."""
    gen = torch.Generator().manual_seed(2)
    data = [
        random_examples(pp_examples_per_slot(s), s.example_tokens, vocab, gen)
        for _ in range(s.slots)
    ]
    per_batch = -(-s.slots * pp_examples_per_slot(s) // s.pp_micro_batches)
    return data, per_batch * (s.example_tokens - 1)


def pp_trainer_step(s: Settings) -> Callable[[], StepResult]:
    """The package's trainer step of every slot on this rank's share of the global batch,
    under the layout ``init_parallel`` set up (pipeline stages; the rest of the world is
    data-parallel). Packing is part of the step."""
    cfg = pp_model_config(s)
    data, budget = pp_data(s, cfg.vocab_size)
    model = [build_model(cfg, s, s.slots)]  # this rank's stage (the whole model at PP=1)
    train = SlotStep(model, s.slots, budget, pad_multiple=1, pad_id=0)
    steps = 10**6  # constant schedule: the count only bounds the lr schedule
    opts = start_jobs(model, s, cfg, steps, s.slots)
    return lambda: train.train(slot_work(data, opts))  # each rank takes its share


def pp_timed(clock: Clock, step: Callable[[], StepResult]) -> tuple[float, list[float]]:
    """Seconds of one lockstep step (both ranks start together after a barrier, the slower
    one counts) and its per-job losses."""
    torch.distributed.barrier()
    start = clock.now()
    result = step()
    elapsed = torch.tensor([clock.now() - start], dtype=torch.float64)
    torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
    return float(elapsed), result.losses.tolist()


def pp_blocks(s: Settings) -> list[int]:
    """The rounds of each block: ``rounds`` in blocks of ``PP_ROUNDS_PER_BLOCK``."""
    return [
        min(PP_ROUNDS_PER_BLOCK, s.rounds - done)
        for done in range(0, s.rounds, PP_ROUNDS_PER_BLOCK)
    ]


def pp_block(
    s: Settings, clock: Clock, layouts: dict[str, int], block: int
) -> dict[str, dict[str, list[float]]]:
    """One block of rounds of each layout (name -> pipeline size), one after another: build
    it, run ``max(2, warmup)`` untimed steps, time the block's rounds, tear it down. Returns
    the times and each layout's second-step losses (after one update: do the layouts train
    alike?)."""
    rounds = pp_blocks(s)[block]
    out: dict[str, dict[str, list[float]]] = {"samples": {}, "check_losses": {}}
    for name, pipeline in layouts.items():
        mm.init_parallel(pipeline_model_parallel_size=pipeline, seed=0)
        step = pp_trainer_step(s)
        timed = [pp_timed(clock, step) for _ in range(max(2, s.warmup) + rounds)]
        mm.destroy_parallel()
        out["check_losses"][name] = timed[1][1]
        out["samples"][name] = [elapsed for elapsed, _ in timed[max(2, s.warmup) :]]
        clock.say(
            f"PP block {block + 1}/{len(pp_blocks(s))} {name}: "
            + ", ".join(f"{x * 1e3:.1f}" for x in out["samples"][name])
            + " ms"
        )
    return out


def pp_worker(s: Settings, result_file: str, block: int) -> None:
    """Run under torchrun with 2 processes: one block of PP=2 and DP=2 rounds (in alternating
    order from block to block)."""
    names = list(PP_LAYOUTS) if block % 2 == 0 else list(reversed(PP_LAYOUTS))
    out = pp_block(s, Clock(torch.device(s.device)), {n: PP_LAYOUTS[n] for n in names}, block)
    if torch.distributed.get_rank() == 0:  # both ranks hold the same (MAX-reduced) times
        Path(result_file).write_text(json.dumps(out))
    torch.distributed.destroy_process_group()


def run_pp(s: Settings, clock: Clock) -> tuple[dict | None, str | None]:
    """PP=1 on this one process (its ``threads``) and PP=2 vs DP=2 in 2 processes (a fresh
    torchrun of this script per block), block by block in alternating order; or why they
    were skipped."""
    if s.skip_pp:
        return None, "skipped: --skip-pp"
    if s.device == "cuda" and torch.cuda.device_count() < 2:
        return None, f"skipped: PP=2 needs 2 GPUs, found {torch.cuda.device_count()}"
    result: dict[str, dict[str, list[float]]] = {"samples": {}, "check_losses": {}}
    blocks = pp_blocks(s)
    for b in range(len(blocks)):
        for part in ("here", "there") if b % 2 == 0 else ("there", "here"):
            if part == "here":
                clock.say(f"PP block {b + 1}/{len(blocks)}: PP=1 on this process")
                got = pp_block(s, clock, {"PP=1 one process": 1}, b)
            else:
                got, skipped = torchrun_two(
                    s,
                    clock,
                    "--pp-worker",
                    f"PP=2 vs DP=2 (block {b + 1}/{len(blocks)})",
                    ["--pp-block", str(b)],
                )
                if got is None:
                    return None, skipped
            for name, times in got["samples"].items():
                result["samples"].setdefault(name, []).extend(times)
            for name, losses in got["check_losses"].items():
                result["check_losses"].setdefault(name, losses)  # the first block's
    mm.init_parallel(seed=0)  # this process's layout again, as before the section
    return result, None


def pp_rows(s: Settings, result: dict | None, skipped: str | None) -> list[Row]:
    cfg = pp_model_config(s)
    layers, e = cfg.num_layers, pp_examples_per_slot(s)
    cpu = s.device == "cpu"
    step = (
        f"one trainer step of {s.slots} adapter jobs (SlotStep.train: pack, forward/backward "
        f"of the micro-batches through megatron's schedule, per-slot grad sync, norms, "
        f"AdamW) on the dense GPT with {layers} layers; a global batch of {e} examples of "
        f"{s.example_tokens} tokens per job, packed into micro-batches of at most "
        f"{pp_data(s, cfg.vocab_size)[1]} positions ({s.pp_micro_batches} in all)"
    )
    pp2 = (
        f"PP=2 runs it on 2 processes ({'1 thread' if cpu else '1 GPU'} each) holding "
        f"{layers // 2} layer{'s' if layers > 2 else ''} each, every micro-batch through "
        "both stages (1F1B schedule)"
    )
    method = (
        f"The layouts are built in turn, in blocks of {PP_ROUNDS_PER_BLOCK} rounds "
        f"(each after {max(2, s.warmup)} untimed steps) in alternating order: PP=1 in "
        "this process, PP=2 and DP=2 in a fresh 2-process torchrun per block; each "
        "2-process round starts both ranks together and counts the slower"
    )
    one = f"{s.threads} thread{'s' if s.threads > 1 else ''}" if cpu else "1 GPU"
    rows = [
        Row(
            "7a",
            "PP=2 vs DP=2: trainer step",
            (
                f"{step}. {pp2}; DP=2 runs it on the same 2 processes, each holding the whole model "
                "and half of every job's examples (gradients summed across them): the same "
                f"{'cores' if cpu else 'GPUs'} used as pipeline stages or as data-parallel ranks. "
                f"{method}"
            ),
            "PP=2",
            "DP=2",
            "ms",
        ),
        Row(
            "7b",
            "PP=2 vs PP=1 (one process): trainer step",
            (
                f"the same step: {pp2}, vs 1 process ({one}) holding the whole model and every "
                "example. " + method
            ),
            "PP=2",
            "PP=1, 1 process",
            "ms",
        ),
    ]
    for row, b in zip(rows, ("DP=2", "PP=1 one process")):
        if result is None:
            row.skipped = skipped
            continue
        med = medians(result["samples"])
        row.fill(med["PP=2"] * 1e3, med[b] * 1e3)
        check = result["check_losses"]
        diff = max(abs(x - y) for x, y in zip(check["PP=2"], check[b]))
        row.note = (
            f"Same training: the {s.slots} per-job losses of the second step (after "
            f"one optimizer update) differ by at most {diff:.1e} between {row.a} and "
            f"{row.b}."
        )
    return rows


def section_pp(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    pp_result, pp_skipped = run_pp(s, clock)
    if pp_result:
        out.samples["trainer step PP"] = pp_result["samples"]
    out.rows += pp_rows(s, pp_result, pp_skipped)

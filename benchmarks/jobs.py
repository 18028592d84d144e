"""Row 4: N adapter jobs trained together vs one after another."""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.report import Results, Row
from benchmarks.settings import Settings
from benchmarks.timing import Clock, medians, time_side_by_side
from benchmarks.workloads import build_model, make_job, model_config, random_examples, training_step
from megatron_multilora.training.runtime import start_job
from megatron_multilora.training.step.slot_step import slot_work


def jobs_variants(s: Settings, device: torch.device) -> dict[str, Callable[[], None]]:
    """``slots`` jobs, each ``job_steps`` steps of ``examples_per_slot`` examples."""
    cfg = model_config("dense", s)
    gen = torch.Generator().manual_seed(1)
    data = [
        [
            random_examples(s.examples_per_slot, s.example_tokens, cfg.vocab_size, gen)
            for _ in range(s.job_steps)
        ]
        for _ in range(s.slots)
    ]
    jobs = [make_job(j, s) for j in range(s.slots)]
    multi_n, multi_1 = build_model(cfg, s, s.slots), build_model(cfg, s, 1)
    steps = range(s.job_steps)
    step_n, together_batches = training_step(
        multi_n, s.slots, [[data[j][t] for j in range(s.slots)] for t in steps], device
    )
    step_1, alone_batches = training_step(
        multi_1, 1, [[data[j][t]] for j in range(s.slots) for t in steps], device
    )

    def together() -> None:
        opts = {j: start_job(multi_n, j, job, s.job_steps, cfg) for j, job in enumerate(jobs)}
        for examples, mbs in together_batches:
            step_n.train(slot_work(examples, opts), micro_batches=mbs)

    def one_after_another() -> None:
        for j, job in enumerate(jobs):
            opts = {0: start_job(multi_1, 0, job, s.job_steps, cfg)}
            for examples, mbs in alone_batches[j * s.job_steps : (j + 1) * s.job_steps]:
                step_1.train(slot_work(examples, opts), micro_batches=mbs)

    return {"together": together, "one-after-another": one_after_another}


def section_jobs(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    clock.say(f"jobs: {s.slots} jobs together vs one after another")
    out.samples["jobs"] = time_side_by_side(
        clock, "jobs", jobs_variants(s, device), s.job_rounds, 1
    )
    med = medians(out.samples["jobs"])
    job_row = Row(
        "4",
        f"{s.slots} jobs together vs one after another",
        (
            f"total wall time to train {s.slots} adapter jobs for {s.job_steps} steps each "
            f"({s.examples_per_slot} examples of {s.example_tokens} tokens per job per step): "
            f"together on one {s.slots}-slot model (one packed micro-batch per step, then every "
            "slot's optimizer step; attention runs per packed example) vs one after another on "
            "a 1-slot model (same base); packing done beforehand, not timed"
        ),
        "together",
        "one after another",
        "s",
    ).fill(med["together"], med["one-after-another"])
    job_row.note = f"Speedup of training together: {1 / job_row.ratio:.2f}x."
    out.rows.append(job_row)

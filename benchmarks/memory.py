"""Row 5: peak memory with N slots vs 1 slot, above the frozen base."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

import megatron_multilora as mm
from benchmarks.children import python_child
from benchmarks.report import MiB, Results, Row
from benchmarks.settings import Settings
from benchmarks.timing import Clock
from benchmarks.workloads import (
    build_model,
    model_config,
    model_step,
    pack_one,
    slot_and_single_examples,
    start_jobs,
    training_step,
)
from megatron_multilora.training.step.slot_step import slot_work


def memory_probe(s: Settings, variant: str) -> dict:
    """Peak memory of two training steps of the dense model (``variant``: "base", or a slot
    count); runs in a fresh process so the peak is this variant's alone."""
    device = torch.device(s.device)
    mm.init_parallel(seed=0)
    cfg = model_config("dense", s)
    many = pack_one(slot_and_single_examples(s, cfg.vocab_size)[0], device)
    result: dict = {"variant": variant}
    with tensor_memory_peak(device) as peak:
        if variant == "base":
            model = build_model(cfg, s, None)
            for _ in range(2):
                model_step(model, many)
        else:
            slots = int(variant)
            model = build_model(cfg, s, slots)
            per_slot, single = slot_and_single_examples(s, cfg.vocab_size)
            train, ((examples, mbs),) = training_step(
                model, slots, [per_slot if slots > 1 else single], device
            )
            opts = start_jobs(model, s, cfg, 2, slots)
            for _ in range(2):
                train.train(slot_work(examples, opts), micro_batches=mbs)
            params = mm.slot_parameters(model, 0)
            result.update(
                params_per_slot=sum(p.numel() for p in params), param_bytes=params[0].element_size()
            )
    result["peak_bytes"] = peak["bytes"]
    mm.destroy_parallel(destroy_process_group=True)
    return result


@contextlib.contextmanager
def tensor_memory_peak(device: torch.device) -> Iterator[dict]:
    """The peak bytes held by tensors while the block runs (model weights included).

    CUDA: the caching allocator's own peak. CPU has no such counter and a process's peak RSS
    moves by +-10 MiB with allocator and thread noise, so every tensor allocation and free is
    recorded with torch's profiler and replayed in order (the timeline behind
    ``torch.profiler.profile.export_memory_timeline``): exact and repeatable.
    """
    out: dict = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        yield out
        out["bytes"] = torch.cuda.max_memory_allocated()
        return
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfile

    # Shapes are needed (the timeline's data flow uses them), stacks are not: the same peaks
    # for every variant, and half the replay time.
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=False
    ) as prof:
        yield out
    held = peak = 0
    for _, action, _, size in MemoryProfile(prof.profiler.kineto_results).timeline:
        if action in (Action.PREEXISTING, Action.CREATE):
            held += size
        elif action == Action.DESTROY:
            held -= size
        peak = max(peak, held)
    out["bytes"] = peak


def run_memory_probes(s: Settings, clock: Clock) -> dict[str, list[dict]]:
    """``memory_probes`` rounds of fresh-process probes, one of each variant per round. A
    round's probes run concurrently: each process's peak is its own, so only time is shared."""
    probes: dict[str, list[dict]] = {v: [] for v in ("base", "1", str(s.slots))}
    for k in range(s.memory_probes):
        with tempfile.TemporaryDirectory() as tmp:
            outs = {v: Path(tmp) / f"probe-{v}.json" for v in probes}
            procs = [
                python_child(
                    [
                        "--memory-probe",
                        v,
                        "--settings-json",
                        json.dumps(dataclasses.asdict(s)),
                        "--result-file",
                        str(out),
                    ]
                )
                for v, out in outs.items()
            ]
            if any(proc.wait() for proc in procs):
                raise RuntimeError("a memory probe failed (its output is above)")
            for v, out in outs.items():
                probes[v].append(json.loads(out.read_text()))
        clock.say(
            f"memory probes {k + 1}/{s.memory_probes}: "
            + ", ".join(f"{v} {ps[-1]['peak_bytes'] / MiB:.1f} MiB" for v, ps in probes.items())
        )
    return probes


def adapter_state_bytes(probe: dict, slots: int) -> int:
    """Adapter weights + fp32 gradient buffer + AdamW's two fp32 moments (+ fp32 masters
    for non-fp32 weights), for ``slots`` slots."""
    elt = probe["param_bytes"]
    per_param = elt + 4 + 8 + (0 if elt == 4 else 4)
    return probe["params_per_slot"] * slots * per_param


def memory_row(s: Settings, probes: dict[str, list[dict]]) -> Row:
    peak = {v: statistics.median(p["peak_bytes"] for p in ps) / MiB for v, ps in probes.items()}
    n = str(s.slots)
    row = Row(
        "5",
        f"peak memory: {n} slots vs 1 slot",
        (
            "peak memory of 2 training steps (fwd+bwd+AdamW state) of the dense model, above the "
            "frozen base's own fwd+bwd peak (a fresh process per variant"
            + (f", median of {s.memory_probes}" if s.memory_probes > 1 else "")
            + "; "
            + (
                "torch.cuda.max_memory_allocated"
                if s.device == "cuda"
                else "peak bytes held by tensors, from torch's profiler memory timeline"
            )
            + ")"
        ),
        f"{n} slots",
        "1 slot",
        "MiB",
    ).fill(peak[n] - peak["base"], peak["1"] - peak["base"])
    ref = probes["1"][0]
    state = {k: adapter_state_bytes(ref, int(k)) / MiB for k in ("1", n)}
    row.note = (
        f"The base alone peaks at {peak['base']:.1f} MiB. Adapter state (weights + fp32 grads + "
        f"AdamW moments), analytic: {state['1']:.2f} MiB for 1 slot, {state[n]:.2f} MiB for {n}. "
        f"Of the measured {row.b_value:.2f} MiB for 1 slot, {row.b_value - state['1']:.2f} MiB "
        f"is beyond the adapter state: the LoRA path's activations and temporaries. Going "
        f"from 1 to {n} slots adds "
        f"{row.a_value - row.b_value:.2f} MiB measured vs {state[n] - state['1']:.2f} MiB of "
        "adapter state: there is no per-slot copy of the base."
    )
    return row


def section_memory(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    clock.say("memory probes (fresh processes)")
    out.probes = run_memory_probes(s, clock)
    out.rows.append(memory_row(s, out.probes))

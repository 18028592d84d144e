"""The rows 10 report: ours vs each way a user would run instead."""

from __future__ import annotations

import statistics

import torch

from benchmarks.peers.launch import run_peers
from benchmarks.peers.spec import PEFT_WAYS, WAY_TEXT
from benchmarks.peers.step_costs import STEP_PARTS
from benchmarks.report import Results, Row
from benchmarks.settings import Settings
from benchmarks.timing import Clock


def peers_rows(peers: dict) -> list[Row]:
    """Rows 10a-10c (training wall) and 10d-10f (CPU seconds), ours (A) vs each peft way;
    10g-10h ours on one core vs peft one job after another on one core; 10i-10k one global
    step on one core, part by part (:func:`step_cost_rows`)."""
    res, spec = peers["results"], peers["spec"]
    med = {
        w: {k: statistics.median(r[k] for r in rs) for k in ("train_s", "launch_s", "cpu_s")}
        for w, rs in res.items()
    }
    names = [j["name"] for j in spec["jobs"]]
    loss = {
        w: {n: statistics.median(r["eval_loss"][n] for r in rs) for n in names}
        for w, rs in res.items()
    }
    jobs = "; ".join(
        f"{j['name']} r{j['rank']} alpha {j['alpha']:g}"
        + (f" dropout {j['dropout']:g}" if j["dropout"] else "")
        + f" {j['schedule']}"
        for j in spec["jobs"]
    )
    j0 = spec["jobs"][0]
    setting = (
        f"{len(names)} LoRA jobs of conf/jobs/demo4.yaml ({jobs}; each lr {j0['lr']:g}, "
        f"warmup {j0['warmup_steps']}, global batch {j0['global_batch_size']}, grad clip "
        f"{j0['grad_clip']}, AdamW wd {j0['weight_decay']:g}), {spec['steps']} steps each, "
        f"fp32, on the tiny random HF Llama of scripts/make_demo_data.py (LoRA on "
        f"{'/'.join(spec['targets'])} = our {', '.join(spec['our_targets'])})"
    )
    timing = (
        "training wall = from the start of the first training step to the end of the "
        "last (setup, model and data loading, final evaluation and export left out; "
        "ours from its metrics.jsonl record times, one record per step; a first step "
        "counted at the median step time on every side)"
    )
    rows = []
    for i, way in enumerate(PEFT_WAYS):
        what = (
            f"{setting}: {WAY_TEXT['ours']} vs {WAY_TEXT[way]}; {timing}"
            if i == 0
            else f"as row 10a, vs {WAY_TEXT[way]}"
        )
        row = Row(
            f"10{'abc'[i]}",
            f"{len(names)} adapter jobs: ours vs {way}: training wall",
            what,
            "ours",
            way,
            "s",
        )
        row.fill(med["ours"]["train_s"], med[way]["train_s"])
        row.note = (
            f"Whole launch (process start to exit): {med['ours']['launch_s']:.1f} s vs "
            f"{med[way]['launch_s']:.1f} s. Held-out loss per job (ours / {way}): "
            + ", ".join(f"{n} {loss['ours'][n]:.3f} / {loss[way][n]:.3f}" for n in names)
            + "; base model "
            + ", ".join(f"{n} {v:.3f}" for n, v in res["ours"][0]["base_eval_loss"].items())
            + "."
        )
        rows.append(row)
    for i, way in enumerate(PEFT_WAYS):
        row = Row(
            f"10{'def'[i]}",
            f"{len(names)} adapter jobs: ours vs {way}: CPU seconds",
            (
                f"the same runs as row 10{'abc'[i]}: CPU seconds (user + system, getrusage of the "
                "waited child processes) of the whole launch, setup and imports included"
            ),
            "ours",
            way,
            "s",
        )
        row.fill(med["ours"]["cpu_s"], med[way]["cpu_s"])
        loop = statistics.median(r["loop_cpu_s"] for r in res[way])
        row.note = (
            f"Of {way}'s, {loop:.1f} s are its training loops (the rest: imports, "
            "model and data loading, evaluation)."
        )
        rows.append(row)
    one_core = Row(
        "10g",
        f"{len(names)} adapter jobs on one core: ours vs peft-seq-1t: training wall",
        f"as row 10a, {WAY_TEXT['ours-1p']} vs {WAY_TEXT['peft-seq-1t']}",
        "ours-1p",
        "peft-seq-1t",
        "s",
    )
    one_core.fill(med["ours-1p"]["train_s"], med["peft-seq-1t"]["train_s"])
    one_core.note = (
        f"Whole launch: {med['ours-1p']['launch_s']:.1f} s vs "
        f"{med['peft-seq-1t']['launch_s']:.1f} s. Held-out loss per job (ours-1p / "
        "peft-seq-1t): "
        + ", ".join(f"{n} {loss['ours-1p'][n]:.3f} / {loss['peft-seq-1t'][n]:.3f}" for n in names)
        + "."
    )
    cpu = Row(
        "10h",
        f"{len(names)} adapter jobs on one core: ours vs peft-seq-1t: CPU seconds",
        "the same runs as row 10g: CPU seconds of the whole launch (as row 10d)",
        "ours-1p",
        "peft-seq-1t",
        "s",
    )
    cpu.fill(med["ours-1p"]["cpu_s"], med["peft-seq-1t"]["cpu_s"])
    return rows + [one_core, cpu] + step_cost_rows(peers, med)


def step_cost_rows(peers: dict, med: dict) -> list[Row]:
    """Rows 10i-10k: one global step of every job on one core, ours vs peft, part by part;
    the note of 10k sets it against what two cores give each side (rows 10a, 10c)."""
    costs, spec = peers["step_costs"], peers["spec"]
    part = {
        side: {k: statistics.median(c[k] for c in cs) for k in (*STEP_PARTS, "positions")}
        for side, cs in costs.items()
    }
    n = len(spec["jobs"])
    setting = (
        f"one global step of the {n} jobs of row 10a on one core (1 thread, each job's "
        f"global batch of {spec['jobs'][0]['global_batch_size']} examples, "
        f"{part['ours']['positions']:.0f} positions in all; the same examples on both "
        "sides, medians of 20 repetitions per round, each side in its own process): "
        f"ours packs every job's examples into one step of one model, peft runs its "
        f"{n} loops' steps one after another"
    )
    frozen = Row(
        "10i",
        "one global step on one core: frozen base forward+backward",
        f"{setting}; the base alone (gradient w.r.t. the token embeddings only): "
        "megatron-core GPT (ours) vs HF LlamaForCausalLM",
        "ours",
        "peft",
        "ms",
    )
    frozen.fill(part["ours"]["frozen"], part["peft"]["frozen"])
    lora = Row(
        "10j",
        "one global step on one core: what LoRA adds to forward+backward",
        "as row 10i: forward+backward with every job's LoRA minus the frozen base's",
        "ours",
        "peft",
        "ms",
    )
    lora.fill(
        part["ours"]["lora"] - part["ours"]["frozen"], part["peft"]["lora"] - part["peft"]["frozen"]
    )
    step = Row(
        "10k",
        "one global step on one core: the whole training step",
        "as row 10i: forward+backward with LoRA, gradient norms and clipping, AdamW and "
        "the LR schedule of every job",
        "ours",
        "peft",
        "ms",
    )
    step.fill(part["ours"]["step"], part["peft"]["step"])
    steps = spec["steps"]
    dp2 = 1e3 * med["ours"]["train_s"] / steps
    par = 1e3 * med["peft-par"]["train_s"] / steps
    step.note = (
        f"On two cores (rows 10a, 10c) a global step takes ours {dp2:.1f} ms (2 data-"
        f"parallel processes: {part['ours']['step'] / dp2:.2f}x the one-core step) and "
        f"independent peft processes {par:.1f} ms ({part['peft']['step'] / par:.2f}x)."
    )
    return [frozen, lora, step]


def section_peers(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    out.peers = run_peers(s.peer_steps, s.peer_rounds, clock.say)
    out.rows += peers_rows(out.peers)

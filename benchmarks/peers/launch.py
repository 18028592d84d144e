"""Rows 10: each way launched as a user would, round after round."""

from __future__ import annotations

import itertools
import json
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.children import child_env
from benchmarks.peers.spec import WAYS, job_spec
from benchmarks.peers.step_costs import STEP_PARTS
from benchmarks.settings import REPO

WORKER = [sys.executable, "-m", "benchmarks.peers.worker"]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def training_span(step_end_times: list[list[float]]) -> float:
    """Seconds from the start of the first training step to the end of the last, over one
    or more loops (processes or jobs); a loop's first step is counted at its median step
    time (ours cannot time it: its first metrics record comes after step 1), so one-time
    warm-up in step 1 is left out on every side alike."""
    starts, ends = [], []
    for times in step_end_times:
        dt = (
            statistics.median(b - a for a, b in itertools.pairwise(times))
            if len(times) > 1
            else 0.0
        )
        starts.append(times[0] - dt)
        ends.append(times[-1])
    return max(ends) - min(starts)


def _env(threads: int) -> dict[str, str]:
    return {**child_env(), "OMP_NUM_THREADS": str(threads)}


def run_ours(spec: dict, data_dir: Path, run_dir: Path, processes: int) -> dict:
    """``mmlora train`` of ``spec``'s run as a user launches it, a metrics record every step;
    its training span, whole launch, CPU seconds, held-out losses, and when (seconds after
    the launch) its first step started, its last ended and its adapter x task table came."""
    cmd = [
        sys.executable,
        "-m",
        "megatron_multilora.cli",
        "train",
        "--nproc",
        str(processes),
        "--config-name",
        spec["config_name"],
        *spec["overrides"],
        f"run_dir={run_dir}",
        "trainer.log_interval=1",
        "trainer.eval_interval=0",
        "checkpoint.save_interval=0",
        "logging.wandb_mode=disabled",
        "logging.plots=false",
    ]
    cpu, start = _children_cpu(), time.perf_counter()
    launched = time.time()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines, table_at = [], None
    for line in proc.stdout:
        lines.append(line)
        if table_at is None and line.startswith("held-out loss of each adapter"):
            table_at = time.time() - launched
    proc.wait()
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
    (run_dir.parent / f"{run_dir.name}.log").write_text("".join(lines))
    if proc.returncode != 0:
        raise RuntimeError(f"ours failed (exit {proc.returncode}): {''.join(lines)[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, spec["steps"] + 1)), "one record per step"
    final = [r for r in records if r["kind"] == "eval"][-1]["adapters"]
    names = [j["name"] for j in spec["jobs"]]
    precision = re.search(r"dp \d+\), (.+?), [\d,]+ trainable parameters", "".join(lines))
    times = [r["time"] for r in train]
    span = training_span([times])
    return {
        "train_s": span,
        "launch_s": wall,
        "cpu_s": cpu,
        "first_step_at_s": times[-1] - span - launched,
        "last_step_at_s": times[-1] - launched,
        "table_at_s": table_at,
        "precision": precision.group(1),
        "eval_loss": {n: final[n][f"loss_on_{n}"] for n in names},
        "base_eval_loss": {n: final["base"][f"loss_on_{n}"] for n in names},
    }


def run_peft(spec: dict, groups: list[list[int]], threads: int, tmp: Path) -> dict:
    """One worker process per group of jobs, all at once; each trains its jobs in turn (under
    bf16 autocast where ``spec["autocast"]`` is "bf16")."""
    spec_file = tmp / "spec.json"
    spec_file.write_text(json.dumps(spec))
    procs, results = [], []
    cpu, start = _children_cpu(), time.perf_counter()
    for k, group in enumerate(groups):
        result = tmp / f"peft-{threads}t-{k}.json"
        results.append(result)
        cmd = [
            *WORKER,
            "--peft-worker",
            "--spec",
            str(spec_file),
            "--jobs",
            ",".join(map(str, group)),
            "--threads",
            str(threads),
            "--result-file",
            str(result),
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                env=_env(threads),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate()[0] for p in procs]
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
    for p, text in zip(procs, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"peft worker failed (exit {p.returncode}): {text[-2000:]}")
    got = [json.loads(r.read_text()) for r in results]
    jobs = {n: j for g in got for n, j in g["jobs"].items()}
    return {
        "train_s": training_span(
            [[t for j in g["jobs"].values() for t in j["step_end_times"]] for g in got]
        ),
        "launch_s": wall,
        "cpu_s": cpu,
        "loop_cpu_s": sum(g["loop_cpu_s"] for g in got),
        "eval_loss": {n: j["eval_loss"] for n, j in jobs.items()},
        "positions": sum(j["positions"] for j in jobs.values()),
        "lora_params": {n: j["params"] for n, j in jobs.items()},
    }


def run_way(way: str, spec: dict, data_dir: Path, tmp: Path, round_: int) -> dict:
    n = len(spec["jobs"])
    if way in ("ours", "ours-1p"):
        return run_ours(spec, data_dir, tmp / f"{way}-{round_}", 1 if way == "ours-1p" else 2)
    if way == "peft-seq-1t":
        return run_peft(spec, [list(range(n))], 1, tmp)
    if way == "peft-seq-2t":
        return run_peft(spec, [list(range(n))], 2, tmp)
    half = (n + 1) // 2
    return run_peft(spec, [list(range(half)), list(range(half, n))], 1, tmp)


def run_step_costs(spec: dict, side: str, tmp: Path) -> dict:
    """:func:`step_cost_worker` of ``side`` in its own process (1 thread)."""
    spec_file, result = tmp / "spec.json", tmp / f"step-{side}.json"
    spec_file.write_text(json.dumps(spec))
    cmd = [*WORKER, "--step-worker", side, "--spec", str(spec_file), "--result-file", str(result)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(1), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{side} step worker failed (exit {proc.returncode}): {proc.stderr[-2000:]}"
        )
    return json.loads(result.read_text())


def run_peers(steps: int, rounds: int, say) -> dict:
    """Every way, then the step-cost workers, once per round, in turn; returns per-way lists
    of results, per-side lists of step costs, and the spec."""
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp_name:
        tmp = Path(tmp_name)
        data_dir = tmp / "demo"
        subprocess.run(
            [
                sys.executable,
                str(REPO / "scripts" / "make_demo_data.py"),
                "--out-dir",
                str(data_dir),
            ],
            cwd=REPO,
            env=_env(1),
            check=True,
            capture_output=True,
        )
        spec = job_spec(data_dir, steps)
        say(f"peers: {len(spec['jobs'])} demo4 jobs x {steps} steps; LoRA on {spec['targets']}")
        results: dict[str, list[dict]] = {w: [] for w in WAYS}
        costs: dict[str, list[dict]] = {"ours": [], "peft": []}
        for r in range(rounds):
            for way in WAYS:
                got = run_way(way, spec, data_dir, tmp, r)
                results[way].append(got)
                say(
                    f"peers round {r + 1}/{rounds}: {way}: training {got['train_s']:.1f} s, launch "
                    f"{got['launch_s']:.1f} s, CPU {got['cpu_s']:.1f} s; held-out loss "
                    + ", ".join(f"{k} {v:.3f}" for k, v in got["eval_loss"].items())
                )
            for side in costs:
                got = run_step_costs(spec, side, tmp)
                costs[side].append(got)
                say(
                    f"peers round {r + 1}/{rounds}: one global step on one core, {side}: "
                    + ", ".join(f"{k} {got[k]:.1f} ms" for k in STEP_PARTS)
                )
        spec = {k: v for k, v in spec.items() if k != "hf_dir"}
        for job in spec["jobs"]:
            job["dataset"] = Path(job["dataset"]).name
            job["eval_dataset"] = Path(job["eval_dataset"]).name
        return {"spec": spec, "results": results, "step_costs": costs}

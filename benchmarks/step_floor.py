"""Where a run's training time goes against the compute limit (row 13b): each step's cost
split into a part that does not depend on its positions and a part per position.

    PYTHONPATH=. .venv/bin/python -m benchmarks.step_floor            # the main job (smollm2), ~2 min
    PYTHONPATH=. .venv/bin/python -m benchmarks.step_floor --config-name config data_dir=...

One process, one thread: the trainer is set up from conf/ as the recipe sets it up (the run's
data, model and jobs), then one data-parallel rank's step (``SlotStep.train``) is timed on its share
(1/1, 1/2, 1/4, 1/8) of each phase's global batch: every job at once, and the job with the
most steps alone (the main job's sort_words, which trains alone for 80 of its 120 steps).
A least-squares line through each phase's (positions, median ms) gives the fixed ms a step
costs and its ms per position; the limit's ms per position is 4 FLOPs per matmul parameter
at this core's 1-thread fp32 GEMM rate (:func:`benchmarks.mainjob.gemm_rate`). With two
data-parallel ranks (the share 1/2) the run's training then takes about ``steps x fixed +
positions x per position`` per rank, before the gradient reduction and the two processes'
slowing of each other. ``--compile`` adds what compiling would give (one llama MLP block,
RMSNorm -> fc1 -> SwiGLU -> fc2 -> residual, at the alone phase's positions of rank 0's
half and the run's sizes, forward and backward): ``torch.compile``'s cold compile seconds and
the block's ms eager and compiled. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_multilora.training.step.micro_batches import shard_for_data_parallel

SHARES = (1, 2, 4, 8)


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through ``points``."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def _phase(trainer, jobs: list, share: int, reps: int, warmup: int) -> tuple[int, float]:
    """(positions, median ms) of rank 0's step on 1/``share`` of ``jobs``' global batch."""
    times, rows = [], []
    for i in range(warmup + reps):
        work, _, order = trainer.board.global_batch(i, jobs)
        share_of = {  # rank 0's share of a world of ``share`` data-parallel ranks
            s: dataclasses.replace(w, items=shard_for_data_parallel(w.items, 0, share))
            for s, w in work.items()
        }
        start = time.perf_counter()
        trainer.rt.step.train(share_of, slot_order=order)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            rows.append(sum(len(e.tokens) for w in share_of.values() for e in w.items))
    return round(statistics.mean(rows)), 1e3 * statistics.median(times)


def compile_probe(rows: int, hidden: int, ffn: int, reps: int = 30) -> dict:
    """Cold-compile seconds and median ms eager / compiled of one MLP block (see above)."""

    def block(x, g, w1, w2):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * g
        gate, up = (h @ w1.t()).chunk(2, dim=-1)
        return x + (torch.nn.functional.silu(gate) * up) @ w2.t()

    x = torch.randn(rows, hidden, requires_grad=True)
    g = torch.ones(hidden, requires_grad=True)
    w1, w2 = 0.02 * torch.randn(2 * ffn, hidden), 0.02 * torch.randn(hidden, ffn)
    compiled = torch.compile(block, dynamic=True)

    def run(fn) -> float:
        start = time.perf_counter()
        fn(x, g, w1, w2).sum().backward()
        return time.perf_counter() - start

    cold = run(compiled)
    eager_ms, compiled_ms = [
        1e3 * statistics.median([run(fn) for _ in range(reps)][5:]) for fn in (block, compiled)
    ]
    return {
        "rows": rows,
        "cold_compile_s": round(cold, 1),
        "eager_ms": round(eager_ms, 3),
        "compiled_ms": round(compiled_ms, 3),
    }


def measure(
    config_name: str,
    overrides: list[str],
    reps: int = 7,
    warmup: int = 2,
    with_compile: bool = False,
) -> dict:
    """The figures described in the module docstring, for the run of ``config_name``."""
    import megatron_multilora as mm
    from benchmarks.mainjob import gemm_rate, matmul_parameters
    from benchmarks.workloads import recipe_run
    from megatron_multilora.training.trainer import Trainer

    mm.support_megatron_here()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as run_dir:
        run = recipe_run(
            [f"run_dir={run_dir}", "checkpoint.resume=never", "logging.plots=false", *overrides],
            config_name=config_name,
        )
        trainer = Trainer(run)
        trainer.setup()
        trainer.board.admit(0)
        every = trainer.board.active()
        longest = max(every, key=lambda job: job.total_steps)
        phases = {"every job": every, f"{longest.name} alone": [longest]}
        out: dict = {"config_name": config_name, "overrides": overrides, "phases": {}}
        for name, jobs in phases.items():
            points = [_phase(trainer, jobs, share, reps, warmup) for share in SHARES]
            fixed, per_position = _fit(points)
            out["phases"][name] = {
                "positions_ms": points,
                "fixed_ms": round(fixed, 1),
                "ms_per_position": round(per_position, 3),
            }
    if with_compile:
        alone = next(reversed(out["phases"].values()))["positions_ms"][1][0]  # share 1/2
        cfg = trainer.rt.model_config
        out["compile"] = compile_probe(alone, cfg.hidden_size, cfg.ffn_hidden_size)
    params = matmul_parameters(Path(run.hf_dir)) if run.hf_dir else None
    if params:
        out["matmul_parameters"] = params
        out["limit_ms_per_position"] = round(4 * params / (gemm_rate() * 1e9) * 1e3, 3)
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-name", default="smollm2")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--compile", action="store_true", help="add the compile probe")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the run")
    args = parser.parse_args(argv)
    print(
        json.dumps(measure(args.config_name, args.overrides, args.reps, with_compile=args.compile))
    )


if __name__ == "__main__":
    main(sys.argv[1:])

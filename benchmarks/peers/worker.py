"""python -m benchmarks.peers.worker: a peft training worker or a step-cost worker of rows 10."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.peers.peft_loop import peft_worker
from benchmarks.peers.step_costs import step_cost_worker


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peers.worker",
        description="workers of the benchmark's peers rows",
    )
    worker = parser.add_mutually_exclusive_group(required=True)
    worker.add_argument("--peft-worker", action="store_true", help="train jobs with peft")
    worker.add_argument(
        "--step-worker", choices=("peft", "ours"), help="time one global step's parts on one core"
    )
    parser.add_argument("--spec", required=True)
    parser.add_argument("--jobs", help="comma-separated job indices (--peft-worker)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--result-file", required=True)
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    if args.step_worker:
        step_cost_worker(spec, args.step_worker, args.result_file)
    else:
        peft_worker(spec, [int(i) for i in args.jobs.split(",")], args.threads, args.result_file)


if __name__ == "__main__":
    main()

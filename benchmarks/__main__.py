"""python -m benchmarks: the benchmark run, or one of its child processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import megatron_multilora as mm

# Before megatron's first import (the benchmark modules below): the CPU shims import it
# without preparing its GPU fusions for torch.compile, a second off every child's start-up.
mm.support_megatron_here()

from benchmarks.memory import memory_probe  # noqa: E402
from benchmarks.pipeline_parallel import pp_worker  # noqa: E402
from benchmarks.run import run_benchmark  # noqa: E402
from benchmarks.settings import ALL_SECTIONS, SECTIONS, parse_settings  # noqa: E402
from benchmarks.tensor_parallel import tp_worker  # noqa: E402


def main() -> None:
    settings, args = parse_settings()
    if not (args.tp_worker or args.pp_worker):  # workers take OMP_NUM_THREADS=1 from torchrun
        torch.set_num_threads(settings.threads)
    if args.memory_probe:
        Path(args.result_file).write_text(json.dumps(memory_probe(settings, args.memory_probe)))
    elif args.tp_worker:
        tp_worker(settings, args.result_file)
    elif args.pp_worker:
        pp_worker(settings, args.result_file, args.pp_block)
    else:
        sections = tuple(s for s in ALL_SECTIONS if s in args.only) if args.only else SECTIONS
        if run_benchmark(settings, args.out_dir, sections):
            sys.exit(1)


if __name__ == "__main__":
    main()

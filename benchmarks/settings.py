"""What a benchmark run depends on: its sizes (full and --quick), sections and settings."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


FULL = dict(
    rounds=11,
    warmup=2,
    slots=8,
    rank=16,
    layer_hidden=1024,
    layer_tokens=2048,
    experts=8,
    model_hidden=256,
    model_layers=4,
    examples_per_slot=2,
    example_tokens=64,
    job_steps=4,
    job_rounds=5,
    memory_probes=1,
    pp_micro_batches=4,
    width_layers=30,
    width_tokens=512,
    width_rounds=5,
    peer_steps=500,
    peer_rounds=3,
    minutes=60,
)


QUICK = dict(
    rounds=2,
    warmup=1,
    slots=8,
    rank=8,
    layer_hidden=128,
    layer_tokens=256,
    experts=4,
    model_hidden=64,
    model_layers=1,
    examples_per_slot=1,
    example_tokens=16,
    job_steps=2,
    job_rounds=2,
    memory_probes=1,
    pp_micro_batches=2,
    width_layers=1,
    width_tokens=64,
    width_rounds=2,
    peer_steps=5,
    peer_rounds=1,
    minutes=2,
)


SECTIONS = (
    "layers",
    "models",
    "jobs",
    "memory",
    "tp",
    "pp",
    "scaling",
    "width",
    "post",
)
"""What a run without ``--only`` runs."""


EXTRA_SECTIONS = ("peers", "api", "rl", "mainjob", "launches", "graphs", "adapters", "soak")
"""Run only when named in ``--only`` (minutes of whole training launches; counts rather than
times, which ``tests/unit/test_launches.py`` holds; CUDA graphs, GPU only; a thousand
adapters' builds; the service's hour-long soak)."""


ALL_SECTIONS = SECTIONS + EXTRA_SECTIONS


@dataclasses.dataclass
class Settings:
    """Everything a run depends on; children (memory probes, TP workers) get a copy."""

    device: str
    dtype: str
    rounds: int
    warmup: int
    slots: int
    rank: int
    layer_hidden: int
    layer_tokens: int
    experts: int
    model_hidden: int
    model_layers: int
    examples_per_slot: int
    example_tokens: int
    job_steps: int
    job_rounds: int
    memory_probes: int
    pp_micro_batches: int
    """micro-batches per trainer step of the global batch of rows 7 (PP=2 needs several)."""
    width_layers: int
    """layers of the SmolLM2-135M-shaped model of row 9 (30: all of them)."""
    width_tokens: int
    width_rounds: int
    peer_steps: int
    """steps per job of rows 10 (conf/jobs/demo4.yaml has 500)."""
    peer_rounds: int
    minutes: int
    """how long each base of rows 17 (the service soak) runs under its tenants."""
    threads: int
    """torch CPU threads of this process and the memory probes (TP/PP workers run 1 each)."""
    quick: bool
    skip_tp: bool
    skip_pp: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16}[self.dtype]

    @property
    def alpha(self) -> float:
        return 2.0 * self.rank


def parse_settings(argv: list[str] | None = None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description="Benchmark multi-LoRA training."
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--dtype", choices=["fp32", "bf16"], help="default: fp32 on cpu, bf16 on cuda"
    )
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds (smoke run)")
    parser.add_argument("--skip-tp", action="store_true", help="skip the 2-process TP rows")
    parser.add_argument("--skip-pp", action="store_true", help="skip the 2-process PP rows")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=ALL_SECTIONS,
        metavar="SECTION",
        help="run only these sections (" + ", ".join(ALL_SECTIONS) + "; peers, "
        "api, rl, mainjob, launches and graphs run only when named here); writes "
        "<out-dir>/cpu-only-<sections>.md and .json instead of cpu.md",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch CPU threads (default: torch's, %(default)s); 1 is steadier "
        "on a machine other jobs load",
    )
    for key, value in FULL.items():
        parser.add_argument(
            "--" + key.replace("_", "-"),
            type=int,
            help=f"default {value} ({QUICK[key]} with --quick)",
        )
    # Internal: how this script runs its own child processes.
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)
    parser.add_argument("--tp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pp-block", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--settings-json", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.settings_json:
        return Settings(**json.loads(args.settings_json)), args
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    sizes = QUICK if args.quick else FULL
    values = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in sizes.items()}
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    return Settings(
        device=args.device,
        dtype=dtype,
        threads=args.threads,
        quick=args.quick,
        skip_tp=args.skip_tp,
        skip_pp=args.skip_pp,
        **values,
    ), args

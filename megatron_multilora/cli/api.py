"""``mmlora api``: the training recipe serving the Tinker-compatible training service
(``megatron_multilora/api/``), launched as ``mmlora train`` launches it.

    mmlora api --run-dir R [--port P] [--keys-file F] [--nproc N] [OVERRIDE ...]
"""

from __future__ import annotations

import argparse
import os

from megatron_multilora.api.heap import SERVICE_ENV
from megatron_multilora.cli.command import Commands
from megatron_multilora.cli.train import train


def api(args: argparse.Namespace) -> int:
    """The recipe with the service on: the user's arguments (Hydra's flags come first), then
    ``api.enabled=true`` and the options as overrides."""
    keys = [f"api.keys_file={os.path.abspath(args.keys_file)}"] if args.keys_file else []
    named = any(
        a in ("--config-name", "-cn") or a.startswith("--config-name=") for a in args.overrides
    )
    config = [] if named else ["--config-name", "api"]  # conf/api.yaml: a Tinker client's
    # The config's jobs are not trained (clients bring their own): adapters=[].
    args.overrides = [
        *config,
        *args.overrides,
        "api.enabled=true",
        f"run_dir={args.run_dir}",
        f"api.port={args.port}",
        f"api.host={args.host}",
        *keys,
        "adapters=[]",
    ]
    # Few malloc arenas and a small oneDNN primitive cache: a service's memory stays flat
    # (api/heap.py).
    for name, value in SERVICE_ENV.items():
        os.environ.setdefault(name, value)
    return train(args)


def add_commands(commands: Commands) -> None:
    sub = commands.add(
        "api",
        api,
        "serve the Tinker-compatible training service: clients of "
        "the tinker SDK train and sample LoRA adapters on this model",
        run_dir=True,
    )
    sub.add_argument("--port", type=int, default=8000, help="default 8000")
    sub.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine only)")
    sub.add_argument(
        "--keys-file",
        help="API keys, one 'tml-...' per line (default: the "
        "MMLORA_API_KEYS variable, comma-separated; there is no default key)",
    )
    sub.add_argument("--nproc", type=int, default=1, help="processes (parallel ranks); default 1")
    sub.add_argument(
        "--all-ranks", action="store_true", help="show every process's output, not only rank 0's"
    )
    sub.set_defaults(overrides=[])
    sub.usage = (
        "mmlora api [-h] --run-dir R [--port P] [--host H] [--keys-file F] [--nproc N] "
        "[OVERRIDE ...]"
    )
    sub.epilog = (
        "OVERRIDE: the recipe's, e.g. --config-name smollm2 lora.slots=8 parallel=tp2 "
        "(without --config-name: conf/api.yaml, ranks up to 32 and 2048-token sequences); "
        "it prints the URL once it answers: point tinker.ServiceClient(base_url=...) "
        "at it"
    )

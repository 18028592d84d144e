"""``mmlora``: train adapter jobs, export them, and talk to a serving training run::

    mmlora train [--nproc N] [OVERRIDE ...]   # the recipe under torchrun
    mmlora api --run-dir R --port P [...]     # the Tinker-compatible training service
    mmlora export SOURCE OUT [--job NAME]     # an adapter as a Hugging Face PEFT folder
    mmlora generate --adapter DIR "PROMPT"    # a PEFT export's greedy generations
    mmlora submit --run-dir R job.yaml        # validate a job completely, then hand it over
    mmlora status --run-dir R [--json]        # the trainer's state and a row per job
    mmlora cancel --run-dir R NAME            # stop one job at the next step boundary
    mmlora stop --run-dir R                   # checkpoint and end the run after this step
    mmlora --version

Every refusal exits with code 2 and writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata

from megatron_multilora.cli import api, export, generate, jobs, train
from megatron_multilora.cli.command import EXIT_REFUSED, CommandError, Commands


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmlora",
        description="Train adapter jobs, export them, and talk to a serving training run.",
        epilog="Training: mmlora train --nproc 2 trainer.steps_per_job=50 (any Hydra override "
        "of conf/config.yaml). Serve mode: launch with trainer.serve=true, then submit, "
        "status, cancel and stop talk to it through its run directory. Training service: "
        "mmlora api --run-dir R --port 8000 (tinker SDK clients; README).",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"mmlora (megatron-multilora) {metadata.version('megatron-multilora')}",
    )
    commands = Commands(parser)
    for module in (train, api, export, generate, jobs):
        module.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and not hasattr(args, "overrides"):
            parser.parse_args(argv)  # argparse's own error for arguments no command takes
    except SystemExit as exit_:  # --help / --version (0) or a usage error (2), already printed
        return int(exit_.code or 0)
    if extra:
        args.overrides = extra
    try:
        return args.run(args)
    except CommandError as err:
        print(f"mmlora {args.command_name}: error: {err}", file=sys.stderr)
        return EXIT_REFUSED
    except BrokenPipeError:  # the reader went away (`mmlora status --json | head`): not an error
        # Python would report the pipe again while flushing stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0

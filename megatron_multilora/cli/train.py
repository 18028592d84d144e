"""``mmlora train``: the training recipe under torchrun, as torchtune's ``tune run`` does.

    mmlora train [--nproc N] [OVERRIDE ...]

runs ``torchrun --standalone --nproc-per-node N recipes/multi_lora_finetune.py OVERRIDE ...``
in this process (rank 0's output only, one torch thread per process when there are several)
and ends in one line instead of torchrun's traceback: a stop by signal (Ctrl-C, a
scheduler's SIGTERM, either to this process or to the workers) exits 128 + the signal, a
failed worker with its own exit status (2: a refused config) and its message.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from megatron_multilora.cli.command import CommandError, Commands
from megatron_multilora.training.stop import STOP_SIGNALS

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "multi_lora_finetune.py"


def torchrun_arguments(nproc: int, all_ranks: bool, overrides: list[str]) -> list[str]:
    arguments = ["--standalone", "--nproc-per-node", str(nproc)]
    if nproc > 1 and not all_ranks:
        arguments += ["--local-ranks-filter", "0"]  # the trainer reports from rank 0
    return [*arguments, str(RECIPE), *overrides]


def _failure_line(rank: int, code: int, message: object, shown: bool) -> str:
    """What ended the launch: the recipe writes its message to torchelastic's error file
    (rank 0 also prints it); a crash without one is only in that rank's output."""
    line = f"mmlora train: rank {rank} exited with status {code}"
    if isinstance(message, dict):
        return f"{line}: {message['message']}" if not shown else f"{line} (its message is above)"
    if shown:
        return f"{line} (its output is above)"
    return f"{line}; only rank 0's output is shown: rerun with --all-ranks to see rank {rank}'s"


def _check_config(nproc: int, overrides: list[str]) -> None:
    """The recipe's own config checks (``training/checks.validate``) for ``nproc`` processes,
    run here first; ConfigError lists every problem. A launch with flags other than
    ``--config-name`` (a sweep, Hydra's own) is left to the recipe, as is anything that
    fails here for another reason."""
    from hydra import compose, initialize_config_dir

    from megatron_multilora.training.checks import validate
    from megatron_multilora.training.config import ConfigError, load_run_config

    name, rest = "config", []
    given = iter(overrides)
    for argument in given:
        if argument in ("--config-name", "-cn"):
            name = next(given, name)
        elif argument.startswith("--config-name="):
            name = argument.split("=", 1)[1]
        elif argument.startswith("-") or argument.lstrip("+~").startswith("hydra"):
            return
        else:
            rest.append(argument)
    world = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(nproc)  # what the checks read under torchrun
    try:
        with initialize_config_dir(str(RECIPE.parents[1] / "conf"), version_base="1.3"):
            run = load_run_config(compose(name, overrides=rest))
        validate(run)
    except ConfigError:
        raise
    except Exception:  # the recipe reports it in full
        return
    finally:
        if world is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = world


class _StoppedBeforeLaunch(Exception):
    def __init__(self, signum: int) -> None:
        self.signum = signum


def _stop_before_launch(signum: int, frame: object) -> None:
    raise _StoppedBeforeLaunch(signum)


def train(args: argparse.Namespace) -> int:
    """Checks, then torchrun; a stop signal before torchrun takes over (it passes later ones
    on to the workers) ends here, with its line."""
    previous = {sig: signal.signal(sig, _stop_before_launch) for sig in STOP_SIGNALS}
    try:
        return _launch(args)
    except _StoppedBeforeLaunch as stop:
        print(
            f"mmlora {args.command_name}: stopped by {signal.Signals(stop.signum).name} "
            "before the workers started; nothing ran",
            file=sys.stderr,
        )
        return 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _launch(args: argparse.Namespace) -> int:
    if not RECIPE.is_file():
        raise CommandError(
            f"the recipe {RECIPE} is not here: mmlora train runs from a checkout "
            "of the repository (pip install -e .), which holds recipes/ and conf/"
        )
    if args.nproc < 1:
        raise CommandError(f"--nproc {args.nproc}: give at least 1 process")
    from megatron_multilora.training.config import ConfigError
    from megatron_multilora.training.overrides import checked_overrides

    try:  # refused here, before torchrun starts (no launcher's warning and failure lines)
        args.overrides = checked_overrides(args.overrides)
        _check_config(args.nproc, args.overrides)
    except ConfigError as err:
        raise CommandError(str(err)) from None
    # Imported here: the serve commands stay torch-free.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if args.nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # the processes share the cores
    arguments = torchrun_arguments(args.nproc, args.all_ranks, args.overrides)
    print(f"mmlora {args.command_name}: torchrun {' '.join(arguments)}", flush=True)
    try:
        run(get_args_parser().parse_args(arguments))
    except SignalException as stop:  # torchrun passed the signal on and waited for the workers
        print(
            f"mmlora {args.command_name}: stopped by {signal.Signals(stop.sigval).name} (the "
            "workers' last line says where they stopped and how to resume)",
            file=sys.stderr,
        )
        return 128 + stop.sigval
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
        shown = rank == 0 or args.nproc == 1 or args.all_ranks
        print(_failure_line(rank, code, failure.message, shown), file=sys.stderr)
        return code
    return 0


def add_commands(commands: Commands) -> None:
    sub = commands.add("train", train, "train adapter jobs: the recipe under torchrun")
    sub.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="processes (data/tensor/expert/pipeline parallel ranks); default 1",
    )
    sub.add_argument(
        "--all-ranks", action="store_true", help="show every process's output, not only rank 0's"
    )
    # Every argument the command does not know is the recipe's (Hydra's), in order.
    sub.set_defaults(overrides=[])
    sub.usage = "mmlora train [-h] [--nproc N] [--all-ranks] [OVERRIDE ...]"
    sub.epilog = (
        "OVERRIDE: what the recipe takes, e.g. trainer.steps_per_job=50 parallel=tp2 "
        "--config-name smollm2 (Hydra's overrides and flags)"
    )

"""Fine-tune N LoRA adapter jobs at once on one frozen Megatron-core model.

    mmlora train --nproc 2 [adapters.0.lr=3e-4 trainer.steps_per_job=50 parallel.tp=2 ...]
    torchrun --standalone --nproc-per-node 2 recipes/multi_lora_finetune.py [...]   # the same

The story: check the config, start the parallel layout, build the model and wrap it with
adapter slots, load every job's data, then train (megatron_multilora/training/trainer.py).
Each trainer step packs every active job's global batch into adapter-major micro-batches,
runs them through megatron's pipeline schedule with per-adapter loss normalisation, and
steps each adapter's own optimizer. A job that reaches its budget is exported and its slot
handed to the next queued job; jobs submitted with `mmlora submit` join the queue at a step
boundary (trainer.serve=true keeps the run up for them). At the end jobs that
trainer.max_steps cut short are exported as they are, every exported adapter is evaluated on
every job's held-out data, and the run exits with status 1 if a job failed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import megatron_multilora as mm  # light: its names load megatron on first use
from megatron_multilora.errors import RunError
from megatron_multilora.training.checks import validate
from megatron_multilora.training.config import ConfigError, RunConfig, load_run_config
from megatron_multilora.training.overrides import checked_overrides
from megatron_multilora.training.stop import (
    RunStopped,
    die_with_launcher,
    end_at_once_on_signals,
    exit_without_teardown,
    stop_on_signals,
)


def checked_run(cfg: DictConfig, run_dir: str) -> RunConfig:
    """The run ``cfg`` describes, writing into ``run_dir``; ConfigError lists every problem
    (before any process-group work or slow import)."""
    run = load_run_config(cfg)
    run.run_dir = run_dir
    validate(run)
    return run


def _report_and_exit(message: str, code: int, printed: bool = False, now: bool = False) -> None:
    """End this process with ``message`` as the launch's one visible error: printed once (by
    the first process; ``printed``: already) and, under torchrun, written to the error file
    its failure summary shows as the root cause, so the message is also the last thing a user
    reads. ``now``: from a signal handler, which may interrupt any code (no cleanup runs)."""
    if int(os.environ.get("RANK", "0")) == 0:
        if not printed:
            print(message, file=sys.stderr, flush=True)
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:  # torchelastic's error-file format
            with open(error_file, "w") as f:
                json.dump(
                    {
                        "message": {
                            "message": message,
                            "extraInfo": {
                                "py_callstack": message,
                                "timestamp": str(int(time.time())),
                            },
                        }
                    },
                    f,
                )
    elif "TORCHELASTIC_ERROR_FILE" in os.environ:
        # torchrun names the first failure it observes as the root cause: the other ranks
        # leave after rank 0 (which carries the message); torchrun ends them once it exits.
        time.sleep(5)
    if now:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _stopped_at_once(during: str):
    """A stop signal's end where nothing is left to save: its line, then the exit status of
    a process ended by that signal."""

    def end(signum: int) -> None:
        _report_and_exit(
            f"stopped by {signal.Signals(signum).name} {during}", 128 + signum, now=True
        )

    return end


# Starting, setting up, or a second signal while a step runs.
_UNSAVED = (
    "before it could save: run the same command to resume from the latest checkpoint "
    "(checkpoint.resume=auto), or to start again where there is none"
)
# The final evaluation, or a stopped run's.
_SAVED = (
    "after saving: nothing is lost (the run is saved and every ended job's adapter "
    "exported); only the final report was cut short"
)


def _remove_if_empty(folder: Path) -> None:
    """A refused launch writes nothing: Hydra made its output folder before the checks ran."""
    try:
        folder.rmdir()  # only an empty one
    except OSError:
        pass


def _checked_run_dir(path: str) -> str:
    """``run_dir`` as Hydra's run folder, refused here when it is a file: Hydra creates the
    folder before the recipe's own check runs, and would end in a FileExistsError traceback."""
    if os.path.exists(path) and not os.path.isdir(path):
        _report_and_exit(
            f"the run cannot start:\n  - run_dir={path}: is a file, not a folder; "
            "choose another run_dir",
            2,
        )
    return path


OmegaConf.register_new_resolver("checked_run_dir", _checked_run_dir, replace=True)


def _record_config(cfg: DictConfig, run_dir: Path) -> None:
    """What Hydra would write at startup (conf/config.yaml sets hydra.output_subdir=null so
    that a launch that fails validation leaves an existing run_dir untouched)."""
    out = run_dir / "hydra"
    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out / "config.yaml")
    OmegaConf.save(OmegaConf.create(list(HydraConfig.get().overrides.task)), out / "overrides.yaml")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    die_with_launcher()
    try:
        # Hydra's output folder is run_dir for a single run and run_dir-multirun/<n> per sweep job.
        run = checked_run(cfg, HydraConfig.get().runtime.output_dir)
    except ConfigError as err:
        _remove_if_empty(Path(HydraConfig.get().runtime.output_dir))
        _report_and_exit(str(err), 2)
    if int(os.environ.get("RANK", "0")) == 0:
        _record_config(cfg, Path(run.run_dir))
    if run.api.enabled:  # the training service instead of the config's jobs
        _serve_api(run)
        return
    # Only now: megatron loads (seconds), which a bad config is reported without; first the
    # CPU shims where CUDA is absent (they import megatron), TE stand-ins where TE is.
    mm.support_megatron_here()
    from megatron_multilora.training.trainer import Trainer

    trainer = Trainer(run)
    try:
        trainer.setup()
        # SIGTERM / Ctrl-C / `mmlora stop`: finish the step, save, stop (training/stop.py)
        with stop_on_signals():
            trainer.train()
    except RunStopped as stop:
        with end_at_once_on_signals(_stopped_at_once(_SAVED)):
            trainer.final_on_stop(stop)
            message = trainer.stopped(stop)
            mm.destroy_parallel(destroy_process_group=True)
        if stop.exit_code:  # a signal: schedulers see it, and torchrun's summary says why
            _report_and_exit(message, stop.exit_code, printed=True)
        sys.exit(0)
    except RunError as err:  # a damaged file, a full disk: one clear message
        _report_and_exit(str(err), 1)
    with end_at_once_on_signals(_stopped_at_once(_SAVED)):
        failed = trainer.finish()
        mm.destroy_parallel(destroy_process_group=True)  # NCCL warns of a leak at exit otherwise
    if failed:
        _report_and_exit(
            f"{len(failed)} of {len(run.adapters)} adapter jobs FAILED: "
            f"{', '.join(failed)} (see the job lines above); the others were "
            "exported",
            1,
        )


def _serve_api(run: RunConfig) -> None:
    from megatron_multilora.api.api_keys import APIKeyError, load_keys

    try:
        keys = load_keys(run.api.keys_file)
    except APIKeyError as err:
        _report_and_exit(f"the service cannot start:\n  - {err}", 2)
    mm.support_megatron_here()
    from megatron_multilora.api.server import serve_api

    try:
        with stop_on_signals():  # SIGTERM / Ctrl-C / mmlora stop: stop serving, states stay
            serve_api(
                run,
                keys,
                say=lambda line: (
                    print(line, flush=True) if int(os.environ.get("RANK", "0")) == 0 else None
                ),
            )
    except RunError as err:  # a port taken, a damaged file: one clear message
        _report_and_exit(str(err), 1)
    mm.destroy_parallel(destroy_process_group=True)


if __name__ == "__main__":
    # From the first moment a stop signal is said (training records it instead: see main).
    with end_at_once_on_signals(_stopped_at_once(_UNSAVED)):
        try:  # before Hydra, which would refuse a job field its YAML lacks, or a misspelt key
            sys.argv[1:] = checked_overrides(sys.argv[1:])
        except ConfigError as err:
            _report_and_exit(str(err), 2)
        main()  # a failure exits inside (with its status)
    exit_without_teardown()

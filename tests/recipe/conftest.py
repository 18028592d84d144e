"""Recipe tests: the training recipe run in this process (world of one) or as a real
torchrun CLI launch, on small generated demo datasets."""

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import megatron_multilora as mm
from megatron_multilora.data.demo_tasks import write_demo_datasets
from megatron_multilora.training.checks import validate
from megatron_multilora.training.config import load_run_config
from megatron_multilora.training.report.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "conf")
# What a launcher sets for its workers: a test's own launch must not inherit them.
LAUNCHER_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def launch_env(**extra: str) -> dict[str, str]:
    """The environment of a command a test launches as a user would: this one without a
    launcher's variables, one thread per process, this checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


HERE = Path(__file__).resolve().parent
# The longest files, longest first (measured with --durations): scripts/test.sh runs
# this folder in two workers a file at a time, in collection order (--no-loadscope-reorder;
# xdist would otherwise start the files with the most tests first and leave these few-test,
# long ones for the end, where one of them keeps a worker busy while the other has nothing
# left). Files not named here follow, in their usual order.
LONGEST_FIRST = (
    "test_model_families.py",
    "test_api_service.py",
    "test_objectives.py",
    "test_serve.py",
    "test_api_cookbook.py",
    "test_cli.py",
    "test_pipeline.py",
    "test_paging.py",
    "test_api_model_families.py",
    "test_training.py",
    "test_api_rl_loop.py",
    "test_api_paging.py",
    "test_demo.py",
    "test_config_errors.py",
    "test_resume.py",
)


def pytest_collection_modifyitems(items):
    """This folder's files in the order of LONGEST_FIRST (each file's tests in their order);
    other folders' tests keep their places."""
    ours = [item for item in items if item.path.parent == HERE]
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    ordered = iter(sorted(ours, key=lambda item: rank.get(item.path.name, len(rank))))
    items[:] = [next(ordered) if item.path.parent == HERE else item for item in items]


@pytest.fixture(scope="session", autouse=True)
def megatron_here():
    """In-process runs build megatron models (the recipe enables this itself)."""
    mm.support_megatron_here()


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    write_demo_datasets(out, n_train=64, n_eval=8, seed=0)
    return out


def compose_run(overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return load_run_config(compose("config", overrides=overrides))


QUIET = [
    "hf_dir=null",
    "logging.wandb_mode=disabled",
    "logging.plots=false",
    "trainer.log_interval=1",
    "trainer.eval_interval=0",
    "checkpoint.save_interval=null",
    "trainer.micro_batch_tokens=512",
]


def job_fields(name: str, data: Path, task: str, steps: int, **extra) -> dict:
    """One adapter job's fields (an ``adapters`` entry) on a demo task."""
    return {
        "name": name,
        "dataset": f"{data}/{task}.train.jsonl",
        "eval_dataset": f"{data}/{task}.eval.jsonl",
        "rank": 8,
        "alpha": 16,
        "lr": 3e-3,
        "global_batch_size": 4,
        "max_steps": steps,
        **extra,
    }


def job(name: str, data: Path, task: str, steps: int, **extra) -> str:
    """A Hydra override value for one adapter job (:func:`job_fields`)."""
    fields = job_fields(name, data, task, steps, **extra)
    return "{" + ",".join(f"{k}:{v}" for k, v in fields.items()) + "}"


def run_in_process(
    run_dir: Path, jobs: list[str], overrides: list[str] = ()
) -> tuple[dict, object]:
    """Train in this process; returns ({adapter: [train losses by step]}, the trainer)."""
    from megatron_multilora.training.trainer import Trainer

    run = compose_run(
        [*QUIET, f"run_dir={run_dir}", f"adapters=[{','.join(jobs)}]", "lora.slots=2", *overrides]
    )
    validate(run)  # as the recipe does before it builds the trainer
    trainer = Trainer(run)
    trainer.setup()
    trainer.train()
    trainer.finish()
    mm.destroy_parallel()
    return losses_by_adapter(run_dir), trainer


def losses_by_adapter(run_dir: Path, key: str = "loss") -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for record in read_metrics(Path(run_dir) / "metrics.jsonl"):
        if record["kind"] == "train":
            for name, metrics in record["adapters"].items():
                out.setdefault(name, []).append(metrics[key])
    return out

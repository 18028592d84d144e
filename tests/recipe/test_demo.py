"""The main job's configs: the SmolLM2 demo config (four word jobs) composes and trains, its
final tables have the base model's row; `bash scripts/demo.sh --tiny` runs offline."""

import subprocess

import torch
from hydra import compose, initialize_config_dir

import megatron_multilora as mm
from megatron_multilora.data.demo_tasks import WORD_TASKS, write_demo_datasets
from megatron_multilora.models.tiny_hf import write_tiny_llama
from megatron_multilora.training.config import load_run_config
from megatron_multilora.training.report.metrics import read_metrics
from megatron_multilora.training.step import evaluation
from tests.recipe.conftest import CONF, ROOT, launch_env


def test_smollm2_config_trains_the_four_word_jobs_and_reports_the_base_model(tmp_path):
    from megatron_multilora.training.trainer import Trainer

    data = tmp_path / "words"
    write_demo_datasets(data, n_train=16, n_eval=4, seed=0, task_set="words")
    base = write_tiny_llama(tmp_path / "tiny-llama", hidden_size=64)  # SmolLM2's stand-in
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        run = load_run_config(
            compose(
                "smollm2",
                overrides=[
                    f"hf_dir={base}",
                    f"data_dir={data}",
                    f"run_dir={tmp_path / 'run'}",
                    "logging.plots=false",
                    "trainer.max_new_tokens=3",
                    *[f"adapters.{i}.max_steps=2" for i in range(4)],
                ],
            )
        )
    assert [j.name for j in run.adapters] == list(WORD_TASKS)
    recipe = Trainer(run)
    recipe.setup()
    recipe.train()
    recipe.finish()
    final = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "eval"][-1]
    assert set(final["adapters"]) == {"base", *WORD_TASKS}
    assert set(final["adapters"]["base"]) == {
        f"{m}_on_{t}" for m in ("loss", "accuracy") for t in WORD_TASKS
    }
    # The base row is the model without any adapter (every slot is free after finish).
    for task in WORD_TASKS:
        index = list(WORD_TASKS).index(task)
        alone = evaluation.eval_losses(recipe.rt.step, [recipe.board.jobs[index].eval, [], [], []])
        assert torch.isclose(alone[0], torch.tensor(final["adapters"]["base"][f"loss_on_{task}"]))
        adapter, base_row = final["adapters"][task], final["adapters"]["base"]
        assert adapter[f"loss_on_{task}"] != base_row[f"loss_on_{task}"]
    mm.destroy_parallel()


def test_demo_sh_tiny_runs_offline(tmp_path):
    env = launch_env(SKIP_SETUP="1")
    overrides = [
        f"run_dir={tmp_path / 'run'}",
        "logging.wandb_mode=disabled",
        "logging.plots=false",
        "trainer.eval_samples=4",
        *[f"adapters.{i}.max_steps=2" for i in range(4)],
    ]
    proc = subprocess.run(
        ["bash", "scripts/demo.sh", "--tiny", *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for name in ("reverse", "uppercase", "add", "sort"):
        assert f"job {name}: done after 2 steps" in out
        assert (tmp_path / "run" / "peft" / name / "adapter_model.safetensors").is_file()
    assert "\nbase " in out  # the base model's row in the final tables

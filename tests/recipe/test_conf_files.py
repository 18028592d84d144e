"""Every YAML file in conf/ composes, loads onto the schema and validates: run-wide defaults
live only in conf/ (the schema has none), so each file must stay complete and consistent."""

import dataclasses
from pathlib import Path

from hydra import compose, initialize_config_dir

from megatron_multilora.data.demo_tasks import write_post_training_datasets
from megatron_multilora.models.tiny_hf import write_tiny_llama
from megatron_multilora.training import config as schema
from megatron_multilora.training.checks import validate
from megatron_multilora.training.config import load_run_config

CONF = Path(__file__).resolve().parents[2] / "conf"
# Group options that only work beside another choice: expert parallelism needs a MoE model.
# The post-training jobs start from the demo's first-phase adapters, which a run writes.
NO_WARMUP = ["adapters.1.init_from=null", "adapters.2.init_from=null"]
PARTNERS = {
    "parallel=ep2": ["model=tiny_moe", "hf_dir=null"],
    "jobs=post3": NO_WARMUP,
    "post_train": NO_WARMUP,
}


def test_every_yaml_file_in_conf_composes_loads_and_validates(tmp_path, monkeypatch):
    data = tmp_path / "data"
    write_post_training_datasets(data, n_train=16, n_eval=4, seed=0)
    write_post_training_datasets(data, n_train=16, n_eval=4, seed=0, task_set="words")  # words4
    write_tiny_llama(data / "tiny-llama")  # the default hf_dir, ${data_dir}/tiny-llama
    monkeypatch.setenv("WORLD_SIZE", "2")  # the 2-process layouts (tp2, ep2, pp2) need it
    files = sorted(p.relative_to(CONF) for p in CONF.rglob("*.yaml"))
    top = [f.stem for f in files if len(f.parts) == 1]
    options = [f"{f.parts[0]}={f.stem}" for f in files if len(f.parts) == 2]
    assert len(files) == 19 and top == ["api", "config", "gemma3", "post_train", "smollm2"], files
    # mmlora api's config serves 2048-token sequences: the tiny GPT (the tiny Llama has 256).
    base = {name: f"hf_dir={'null' if name == 'api' else data / 'tiny-llama'}" for name in top}
    runs = [(name, [f"data_dir={data}", base[name], *PARTNERS.get(name, [])]) for name in top]
    for option in options:
        # A model option is used when no HF base overrides it.
        extra = ["hf_dir=null"] if option.startswith("model=") else []
        runs.append(("config", [f"data_dir={data}", option, *extra, *PARTNERS.get(option, [])]))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for name, overrides in runs:
            run = load_run_config(compose(name, overrides=overrides))
            validate(run)
            chosen = dict(o.split("=", 1) for o in overrides if "=" in o)
            if chosen.get("model") == "tiny_moe":
                assert run.model.num_moe_experts == 4
            if chosen.get("parallel") == "tp2":
                assert (run.parallel.tp, run.parallel.sp) == (2, True)
            if chosen.get("parallel") == "pp2":
                assert (run.parallel.pp, run.parallel.vpp) == (2, None)
    assert len(runs) == 5 + 14


def test_run_wide_settings_have_their_defaults_only_in_conf():
    for settings in (
        schema.LoRASettings,
        schema.ParallelSettings,
        schema.TrainerSettings,
        schema.LoggingSettings,
        schema.CheckpointSettings,
    ):
        assert all(f.default == "???" for f in dataclasses.fields(settings)), settings
    top = {f.name: f.default for f in dataclasses.fields(schema.RunConfig)}
    assert {top[k] for k in ("hf_dir", "run_dir", "data_dir", "seed")} == {"???"}

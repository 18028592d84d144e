"""A run that cannot work fails before any process-group work, naming every problem."""

import copy
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_multilora.training.checks import validate
from megatron_multilora.training.config import ConfigError, base_model_config
from megatron_multilora.training.objectives.registry import JOB_OBJECTIVES
from tests.recipe.conftest import CONF, ROOT, compose_run, job, launch_env


def test_all_problems_reported_at_once(demo_data, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a=", "completion": "b"}\n\n{"prompt": "a="\n')
    run = compose_run(
        [
            "hf_dir=null",
            "lora.max_rank=7",
            "lora.fully_sharded=true",
            "parallel.tp=2",
            "model.num_attention_heads=3",
            "model.num_query_groups=1",
            f"adapters=[{job('big', demo_data, 'reverse', 3, rank=16)},"
            f"{job('nofile', demo_data, 'add', 3, dataset='/no/such/file.jsonl')},"
            f"{job('broken', demo_data, 'sort', 3, dataset=bad)}]",
            "lora.slots=2",
            "trainer.queue_jobs=false",
        ]
    )
    with pytest.raises(ConfigError) as err:
        validate(run)
    msg = str(err.value)
    assert "adapters.0.rank=16: exceeds lora.max_rank=7" in msg
    assert "lora.max_rank=7 must be a multiple of it" in msg
    assert "num_attention_heads=3 is not divisible by tensor parallel size 2" in msg
    assert "/no/such/file.jsonl" in msg
    assert f"{bad}:3:" in msg  # the malformed line, by number
    assert "3 adapter jobs but lora.slots=2 and trainer.queue_jobs=false" in msg

    run = compose_run([f"adapters=[{job('base', demo_data, 'add', 3)}]"])
    with pytest.raises(ConfigError, match=r"adapters.0.name='base': reserved"):
        validate(run)

    run = compose_run([f"hf_dir={tmp_path}/nowhere", f"adapters=[{job('a', demo_data, 'add', 3)}]"])
    with pytest.raises(ConfigError, match=r"hf_dir: .*nowhere/config.json not found"):
        validate(run)


def test_impossible_pipeline_layouts_are_named(demo_data, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    jobs = f"adapters=[{job('a', demo_data, 'add', 3)}]"

    def problems(*overrides: str) -> str:
        with pytest.raises(ConfigError) as err:
            validate(compose_run(["hf_dir=null", jobs, *overrides]), check_files=False)
        return str(err.value)

    assert "parallel.vpp=2 needs parallel.pp > 1; without pipelining leave it null" in problems(
        "parallel.vpp=2"
    )
    msg = problems("parallel.pp=2", "parallel.vpp=2", "model.num_layers=6")
    assert (
        "model: num_layers=6 does not split into pipeline 2 x virtual stages 2 = 4 equal "
        "model chunks"
    ) in msg
    assert "model: num_layers=3 does not split into pipeline 2 x virtual stages 1" in problems(
        "parallel.pp=2", "model.num_layers=3"
    )
    assert "parallel.tp=2 x parallel.pp=4 must divide the world size 4" in problems(
        "parallel.tp=2", "parallel.pp=4", "model.num_layers=4"
    )
    assert "parallel.ep=4 must divide the 2 processes of each pipeline stage" in problems(
        "parallel.pp=2", "parallel.ep=4", "model=tiny_moe", "model.num_moe_experts=4"
    )
    # A layout that works passes; its data-parallel size is 4 / pp = 2.
    validate(
        compose_run(
            [
                "hf_dir=null",
                f"adapters=[{job('a', demo_data, 'add', 3, global_batch_size=2)}]",
                "parallel=pp2",
                "parallel.vpp=2",
                "model.num_layers=4",
            ]
        ),
        check_files=False,
    )


def test_bf16_base_gemms_on_a_cpu_without_them_are_refused(demo_data, monkeypatch):
    from megatron_multilora.ops import packed_linear

    monkeypatch.setattr(packed_linear, "bf16_gemms_supported", lambda: False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)

    def run(gemms: str):  # no model files checked: the only problem left is the GEMMs'
        return compose_run(
            [
                "hf_dir=null",
                f"adapters=[{job('rev', demo_data, 'reverse', 3)}]",
                f"trainer.cpu_base_gemms={gemms}",
            ]
        )

    with pytest.raises(
        ConfigError,
        match=r"trainer.cpu_base_gemms=bf16: this CPU has no bf16 "
        "GEMMs.*use fp32, or auto",
    ):
        validate(run("bf16"), check_files=False)
    validate(run("auto"), check_files=False)


def test_unknown_key_and_bad_type_name_the_full_key(demo_data):
    with pytest.raises(ConfigError, match=r"trainer.bogus: Key 'bogus' not in 'TrainerSettings'"):
        compose_run(["+trainer.bogus=1"])
    with pytest.raises(
        ConfigError, match=r"trainer.max_seq_len: Value 'long' .* could not be converted"
    ):
        compose_run(["trainer.max_seq_len=long"])
    # In a job: the job's index, not only the field's name.
    with pytest.raises(
        ConfigError, match=r"adapters\.1\.rank: Value 'big' .* could not be converted"
    ):
        compose_run(
            [
                f"adapters=[{job('a', demo_data, 'add', 3)},{job('b', demo_data, 'add', 3, rank='big')}]"
            ]
        )
    with pytest.raises(ConfigError, match=r"adapters\.0\.rnak: Key 'rnak' not in 'AdapterJob'"):
        compose_run([f"adapters=[{job('a', demo_data, 'add', 3, rnak=4)}]"])


def test_validate_leaves_the_config_as_given(demo_data, tmp_path):
    from megatron_multilora.models.tiny_hf import write_tiny_llama

    base = write_tiny_llama(tmp_path / "hf", hidden_size=64)
    run = compose_run([f"hf_dir={base}", f"adapters=[{job('a', demo_data, 'add', 3)}]"])
    before = copy.deepcopy(run)
    validate(run)
    assert run == before  # the HF architecture is resolved where it is used, not written here
    assert base_model_config(run).hidden_size == 64 and run.model.hidden_size == 128


def test_recipe_validates_before_touching_the_process_group(demo_data, tmp_path):
    from hydra import compose, initialize_config_dir

    from recipes.multi_lora_finetune import checked_run

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["hf_dir=null", f"adapters=[{job('a', demo_data, 'add', 3, lr=-1)}]"],
        )
    with pytest.raises(ConfigError, match=r"adapters.0.lr=-1(.0)?: must be > 0"):
        checked_run(cfg, str(tmp_path))  # before main imports and builds the trainer


def test_the_recipe_module_and_config_checks_load_no_megatron_wandb_or_transformers():
    code = (
        "import sys, recipes.multi_lora_finetune; "
        "print([m for m in ('megatron', 'wandb', 'transformers') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "override,message",
    [
        ("adapters.0.lr=-1", "adapters.0.lr=-1.0: must be > 0"),
        ("trainer.max_steps=-1", "trainer.max_steps=-1: must be >= 1 (or null)"),
    ],
)
def test_bad_config_under_torchrun_fails_clearly_and_leaves_the_run_dir_alone(
    demo_data, tmp_path, override, message
):
    run_dir = tmp_path / "run"
    earlier = {
        run_dir / "hydra" / "config.yaml": "the earlier run's config\n",
        run_dir / "multi_lora_finetune.log": "the earlier run's log\n",
        run_dir / "metrics.jsonl": '{"step": 1}\n',
    }
    for path, text in earlier.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    start = time.perf_counter()
    proc = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc-per-node=2",
            "recipes/multi_lora_finetune.py",
            f"run_dir={run_dir}",
            "hf_dir=null",
            f"data_dir={demo_data}",
            override,
        ],
        cwd=ROOT,
        env=launch_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    seconds = time.perf_counter() - start
    assert proc.returncode != 0
    # The message is the last thing shown (the root cause of torchrun's summary), and the
    # processes print it once, not once per rank.
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip("= \n")]
    assert lines[-2:] == ["traceback : the run cannot start:", f"- {message}"], proc.stdout
    assert proc.stdout.count(message) == 2, proc.stdout
    assert sorted(p for p in run_dir.rglob("*") if p.is_file()) == sorted(earlier)
    assert all(path.read_text() == text for path, text in earlier.items())
    assert seconds < 60, f"a bad config took {seconds:.0f} s to report under torchrun"


@pytest.mark.parametrize(
    "override,message",
    [
        ("adapters.0.max_steps=0", "adapters.0.max_steps=0: must be >= 1 (or null)"),
        ("adapters.0.warmup_steps=-2", "adapters.0.warmup_steps=-2: must be >= 0"),
        ("adapters.0.grad_clip=-1.0", "adapters.0.grad_clip=-1.0: must be >= 0.0 (or null)"),
        ("adapters.0.dropout=1.0", "adapters.0.dropout=1.0: must be in [0.0, 1.0)"),
        ("trainer.max_steps=-1", "trainer.max_steps=-1: must be >= 1 (or null)"),
        ("trainer.max_seq_len=0", "trainer.max_seq_len=0: must be >= 2"),
        ("trainer.precision=fp16", "trainer.precision='fp16': must be one of 'fp32', 'bf16'"),
        ("lora.slots=0", "lora.slots=0: must be >= 1"),
        (
            "lora.column_init_method=gaussian",
            "lora.column_init_method='gaussian': must be one of 'xavier', 'kaiming', 'normal', 'zero'",
        ),
        (
            "lora.targets=[linear_qkv,linear_fc_2]",
            "lora.targets.1='linear_fc_2': no such linear; did you mean 'linear_fc2'?",
        ),
        ("model.num_layers=0", "model.num_layers=0: must be >= 1"),
        (
            "checkpoint.resume=atuo",
            "checkpoint.resume='atuo': not auto, never, or a checkpoint folder; "
            "did you mean 'auto'?",
        ),
        ("checkpoint.keep_last=-1", "checkpoint.keep_last=-1: must be >= 0"),
    ],
)
def test_every_setting_is_checked_for_its_range(demo_data, override, message):
    """Each was accepted silently (a negative clip flipped the gradient) or caught only after
    the model was built; now the check names the key, the value and what is allowed."""
    fields = job("a", demo_data, "add", 3, warmup_steps=0, grad_clip=1.0, dropout=0.0)
    run = compose_run(["hf_dir=null", f"adapters=[{fields}]", override])
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        validate(run)
    assert time.perf_counter() - start < 3  # no model is built, nothing is imported
    assert message in str(err.value), str(err.value)
    assert str(err.value).count("\n  - ") == 1, str(err.value)  # that problem alone


def test_a_negative_epoch_count_is_refused(demo_data):
    """It trained one step."""
    fields = job("a", demo_data, "add", "null", epochs=-1)
    with pytest.raises(ConfigError) as err:
        validate(compose_run(["hf_dir=null", f"adapters=[{fields}]"]))
    assert str(err.value).endswith("\n  - adapters.0.epochs=-1.0: must be > 0 (or null)"), err.value


def test_the_run_dir_and_checkpoint_to_resume_are_checked(demo_data, tmp_path):
    jobs = f"adapters=[{job('a', demo_data, 'add', 3)}]"
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ConfigError, match=rf"run_dir={afile}: is a file, not a folder"):
        validate(compose_run(["hf_dir=null", jobs, f"run_dir={afile}"]))
    not_a_checkpoint = tmp_path / "some-folder"
    not_a_checkpoint.mkdir()
    with pytest.raises(
        ConfigError,
        match=rf"checkpoint.resume={not_a_checkpoint}: not a training "
        "checkpoint .it has no state.pt.",
    ):
        validate(compose_run(["hf_dir=null", jobs, f"checkpoint.resume={not_a_checkpoint}"]))


def test_a_damaged_model_folder_is_named(demo_data, tmp_path):
    from megatron_multilora.models.tiny_hf import write_tiny_llama

    base = write_tiny_llama(tmp_path / "hf", hidden_size=64)
    weights = base / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # an interrupted download
    (base / "tokenizer.json").unlink()
    with pytest.raises(ConfigError) as err:
        validate(compose_run([f"hf_dir={base}", f"adapters=[{job('a', demo_data, 'add', 3)}]"]))
    assert f"hf_dir: {weights}: truncated" in str(err.value)
    assert "no tokenizer files" in str(err.value)


def test_every_schema_field_has_a_range_rule_or_another_check():
    """What is checked elsewhere: names and paths (files, folders), free text, booleans,
    choices the model's own check covers, lists checked field by field."""
    import dataclasses

    from megatron_multilora.models.gpt_config import DeltaNetConfig, GPTModelConfig, YarnConfig
    from megatron_multilora.models.mla_config import MLAConfig
    from megatron_multilora.training import config as schema

    elsewhere = {
        "name",
        "dataset",
        "eval_dataset",
        "init_from",
        "targets",
        "fully_sharded",
        "sp",
        "queue_jobs",
        "cuda_graphs",
        "serve",
        "wandb_project",
        "plots",
        "resume",
        "hf_dir",
        "run_dir",
        "data_dir",
        "model",
        "lora",
        "adapters",
        "parallel",
        "trainer",
        "logging",
        "checkpoint",
        "columns",
        *JOB_OBJECTIVES,  # each objective's section: its fields have their rules
        "scale_rewards",
        "reward",
        "train_attn",
        "train_mlp",
        "train_unembed",
        "api",
        "enabled",
        "host",
        "keys_file",
        "model_name",
        "mla",  # multi-latent attention's section: its fields have their rules
        "yarn",  # YaRN's section: likewise
        "linear_attention",  # the Gated DeltaNet's section: likewise
    }
    checked_by_model = {
        f.name
        for model in (GPTModelConfig, MLAConfig, YarnConfig, DeltaNetConfig)
        for f in dataclasses.fields(model)
        if f.type in ("str", "bool", "str | None", "list[str] | None", "list[int] | None")
    }
    for cls in (
        schema.AdapterJob,
        *(o.settings for o in JOB_OBJECTIVES.values() if o.settings),
        schema.LoRASettings,
        schema.ParallelSettings,
        schema.TrainerSettings,
        schema.LoggingSettings,
        schema.CheckpointSettings,
        schema.RunConfig,
        schema.APISettings,
        GPTModelConfig,
        MLAConfig,
        YarnConfig,
        DeltaNetConfig,
    ):
        for field in dataclasses.fields(cls):
            if field.name in elsewhere or (
                cls in (GPTModelConfig, MLAConfig, YarnConfig, DeltaNetConfig)
                and field.name in checked_by_model
            ):
                continue
            assert "rule" in field.metadata, f"{cls.__name__}.{field.name} has no range rule"


def test_a_run_dir_that_is_a_file_is_refused_before_hydra_creates_it(demo_data, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a folder\n")
    proc = subprocess.run(
        [
            sys.executable,
            "recipes/multi_lora_finetune.py",
            f"run_dir={afile}",
            "hf_dir=null",
            f"data_dir={demo_data}",
        ],
        cwd=ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"run_dir={afile}: is a file, not a folder" in proc.stderr
    assert "Traceback" not in proc.stderr and afile.read_text() == "not a folder\n"


def test_cuda_graphs_are_refused_on_cpu_and_name_what_they_need(demo_data, monkeypatch):
    import torch

    jobs = f"adapters=[{job('a', demo_data, 'add', 3)},{job('b', demo_data, 'sort', 3)}]"
    run = compose_run(["hf_dir=null", jobs, "trainer.cuda_graphs=true"])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"trainer.cuda_graphs=true needs a CUDA GPU"):
            validate(run, check_files=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what a GPU machine checks
    monkeypatch.setenv("WORLD_SIZE", "2")
    run = compose_run(
        [
            "hf_dir=null",
            f"adapters=[{job('a', demo_data, 'add', 3)},{job('b', demo_data, 'sort', 3, dropout=0.1)}]",
            "trainer.cuda_graphs=true",
            "trainer.precision=fp32",
            "trainer.recompute=full",
            "parallel.tp=2",
            "model=tiny_moe",
            "lora.max_rank=12",
        ]
    )
    with pytest.raises(ConfigError) as err:
        validate(run, check_files=False)
    msg = str(err.value)
    for need in (
        "trainer.precision=bf16",
        "parallel.tp, pp and ep of 1",
        "a dense model",
        "trainer.recompute=null",
        "adapters.1.dropout=0.1: trainer.cuda_graphs=true replays captured passes",
        "lora.max_rank a multiple of 8 (it is 12",
    ):
        assert need in msg, (need, msg)
    assert "adapters.0.dropout" not in msg
    run = compose_run(["hf_dir=null", jobs, "trainer.cuda_graphs=true", "trainer.precision=bf16"])
    validate(run, check_files=False)  # what the graphs support passes


def test_a_window_shorter_than_the_sequences_is_computed_and_its_layers_checked(demo_data):
    """Window attention is computed: a window below trainer.max_seq_len passes; layer types
    that do not name each layer are refused by name."""
    jobs = f"adapters=[{job('a', demo_data, 'add', 3)}]"
    window = ["hf_dir=null", jobs, "+model.sliding_window=16", "trainer.max_seq_len=32"]
    validate(compose_run(window), check_files=False)
    with pytest.raises(ConfigError, match=r"layer_types=\['sliding_attention'\]: one of"):
        validate(
            compose_run([*window, "+model.layer_types=[sliding_attention]"]), check_files=False
        )


def _refused(
    launch: list[str], run_dir: Path, demo_data: Path, override: str
) -> subprocess.CompletedProcess:
    """``launch`` (the CLI or the recipe) on the tiny base with one override, output kept."""
    args = [*launch, f"run_dir={run_dir}", "hf_dir=null", f"data_dir={demo_data}", override]
    return subprocess.run(
        args, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=120
    )


def test_a_job_entrys_field_its_yaml_lacks_is_overridden_from_the_command_line(demo_data):
    """``adapters.0.dropout=0.1`` with a jobs file that sets no ``dropout`` (words4), and
    ``adapters.1.dpo.beta`` inside an objective's section: every documented field can be
    overridden, a list entry's too (checked_overrides hands them to Hydra as add-or-replace)."""
    from megatron_multilora.training.overrides import checked_overrides

    overrides = ["jobs=words4", f"data_dir={demo_data}", "adapters.0.dropout=0.1"]
    overrides += ["+adapters.1.dpo.beta=0.3", "adapters.2.lr=5e-4"]
    run = compose_run(checked_overrides(overrides))
    assert run.adapters[0].dropout == 0.1 and run.adapters[1].dpo.beta == 0.3
    assert run.adapters[2].lr == 5e-4 and run.adapters[2].dropout == 0.0


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "trainer.step_per_job=5",
            "trainer.step_per_job: no such field; did you mean trainer.steps_per_job?",
        ),
        (
            "+trainer.step_per_job=5",
            "trainer.step_per_job: no such field; did you mean trainer.steps_per_job?",
        ),
        ("adapters.0.lrr=1e-3", "adapters.0.lrr: no such field; did you mean adapters.0.lr?"),
        ("adapters.first.lr=1e-3", "adapters.first: a job is named by its index in the list"),
        ("adapters.0.lr=-1", "adapters.0.lr=-1.0: must be > 0"),
        ("parallel.tp=3", "parallel.tp=3"),
    ],
)
def test_a_misspelt_override_is_refused_before_torchrun_starts(
    demo_data, tmp_path, override, message
):
    """The project's own message (full key, did-you-mean, the fields there; the run's checks
    for 2 processes), exit 2, from `mmlora train` itself: no launcher's warning or failure
    lines, nothing written."""
    run_dir = tmp_path / "run"
    mmlora = [str(Path(sys.executable).parent / "mmlora"), "train", "--nproc", "2"]
    proc = _refused(mmlora, run_dir, demo_data, override)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "mmlora train: error: the run cannot start" in proc.stderr
    assert "torchrun" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert not run_dir.exists()


def test_a_refused_launch_leaves_no_run_dir_behind(demo_data, tmp_path):
    """Hydra makes the run's folder before the checks run: a refused config removes it
    again (it is empty), so a failed launch writes nothing."""
    run_dir = tmp_path / "fresh" / "run"
    recipe = [sys.executable, "recipes/multi_lora_finetune.py"]
    proc = _refused(recipe, run_dir, demo_data, "adapters.0.lr=-1")
    assert proc.returncode == 2 and "adapters.0.lr=-1.0: must be > 0" in proc.stderr
    assert not run_dir.exists()

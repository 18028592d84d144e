"""The training run's configuration schema.

Hydra composes YAML from ``conf/``; :func:`load_run_config` merges it onto these dataclasses
(unknown keys and wrong types fail there, named by their full key); the config check
(:mod:`.checks`) then checks every value's range (the rule on its field here), the layout,
the jobs and their files, and raises once, before anything is built or written. Each field is
documented once, here; its default value is given once, in ``conf/`` (the run-wide settings
have none here), except per-job fields (``AdapterJob``) and model fields, whose defaults are
here and which ``conf/`` files set as they choose.

This module imports neither torch nor megatron (seconds to load), so a bad config is reported
at once and ``mmlora submit`` checks a job without that wait.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_multilora.checkpoint.adapter_folders import declared_rank_alpha
from megatron_multilora.models.gpt_config import GPTModelConfig
from megatron_multilora.training.objectives.registry import DEFAULT, JOB_OBJECTIVES
from megatron_multilora.validation import (
    INIT_METHODS,
    SCHEDULES,
    Rule,
    at_least,
    one_of,
    positive,
    ranged,
    within,
)


class ConfigError(ValueError):
    """A configuration a run cannot start with; the message lists every problem."""


@dataclasses.dataclass
class _JobFields:
    """One fine-tuning job: an adapter trained on its own data with its own hyperparameters;
    :data:`AdapterJob` adds a section per objective with settings."""

    name: str = MISSING
    objective: str = ranged(DEFAULT.name, one_of(*JOB_OBJECTIVES))
    """The job's objective (training/objectives/registry.py: sft, dpo, grpo); its settings
    are the section of its name (dpo, grpo)."""
    dataset: str = MISSING
    """Training data (JSONL, Parquet, JSON or a datasets save_to_disk folder): sft
    {"prompt", "completion"} or {"messages": [...]}; dpo {"prompt", "chosen", "rejected"};
    grpo {"prompt", ...what the reward reads, e.g. "answer"}."""
    eval_dataset: str | None = None
    """Held-out data in the same form, for eval loss (and accuracy of greedy generations);
    without it the job is left out of evaluations and of the end-of-run adapter x task
    table."""
    columns: dict[str, str] = dataclasses.field(default_factory=dict)
    """The record form's fields by the dataset's column names, e.g. {prompt: question,
    completion: answer}."""
    rank: int = ranged(16, at_least(1))
    alpha: float | None = ranged(None, positive(optional=True))
    """LoRA alpha (scale alpha / rank). null: the init_from adapter's own alpha (a PEFT rsLoRA
    alpha converted to the same scale), else 2 * rank. A value that differs from the
    init_from adapter's is refused."""
    dropout: float = ranged(0.0, within(0.0, 1.0))
    """Dropout on this adapter's LoRA input."""
    lr: float = ranged(1e-3, positive())
    warmup_steps: int = ranged(0, at_least(0))
    schedule: str = ranged("cosine", one_of(*SCHEDULES))
    """constant, linear or cosine decay after warmup, down to min_lr_ratio * lr."""
    min_lr_ratio: float = ranged(0.0, Rule("in [0, 1]", lambda v: 0.0 <= v <= 1.0))
    weight_decay: float = ranged(0.0, at_least(0.0))
    grad_clip: float | None = ranged(1.0, at_least(0.0, optional=True))
    """Clip this adapter's gradient norm to this; 0 or null: no clipping."""
    global_batch_size: int = ranged(8, at_least(1))
    """Records per optimizer step, over all data-parallel ranks (dpo: pairs; grpo: prompts
    per rollout, each sampled grpo.group_size times)."""
    max_steps: int | None = ranged(None, at_least(1, optional=True))
    """Optimizer steps to train; or give epochs (trainer.steps_per_job overrides both)."""
    epochs: float | None = ranged(None, positive(optional=True))
    start_step: int = ranged(0, at_least(0))
    """Trainer step from which the job may take a slot (it waits in the queue until then)."""
    init_from: str | None = None
    """An adapter folder to start from instead of a fresh initialisation: one this trainer
    exported, or a Hugging Face PEFT LoRA folder (rank padded up to lora.max_rank). The job's
    rank must be the adapter's; its alpha is the adapter's (see alpha)."""
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    """Which of lora.targets a fresh adapter trains (as a Tinker LoraConfig): attention's
    linears, the MLP's (experts' too), the output layer (where lora.targets has
    output_layer); the others stay zero and its PEFT export leaves them out."""


# A job's fields and one section per objective with settings (its ``settings`` dataclass,
# documented in its module), so an objective adds its section itself.
AdapterJob = dataclasses.make_dataclass(
    "AdapterJob",
    [
        (name, objective.settings, dataclasses.field(default_factory=objective.settings))
        for name, objective in JOB_OBJECTIVES.items()
        if objective.settings is not None
    ],
    bases=(_JobFields,),
)
AdapterJob.__module__, AdapterJob.__doc__ = __name__, _JobFields.__doc__


@dataclasses.dataclass
class LoRASettings:
    slots: int = ranged(MISSING, at_least(1))
    """Adapter slots on the device: the jobs of one step. More jobs than slots wait in a
    queue, or take turns by step with trainer.active_jobs."""
    max_rank: int = ranged(MISSING, at_least(1))
    """Every slot is allocated at this rank; a job's rank may be lower."""
    targets: list[str] = MISSING
    """Linears to wrap: names (linear_qkv, linear_proj, linear_fc1, linear_fc2) or wildcard
    patterns over module paths (e.g. "*.layers.0.*.linear_qkv")."""
    column_init_method: str = ranged(MISSING, one_of(*INIT_METHODS))
    row_init_method: str = ranged(MISSING, one_of(*INIT_METHODS))
    """zero (default) leaves the base model unchanged until the adapter trains."""
    fully_sharded: bool = MISSING
    """Under tensor parallelism, shard every LoRA factor over the TP ranks (S-LoRA layout:
    adapter memory, optimizer state and LoRA GEMMs divide by parallel.tp). Needs max_rank
    divisible by parallel.tp."""


@dataclasses.dataclass
class ParallelSettings:
    tp: int = ranged(MISSING, at_least(1))
    """Tensor parallel size."""
    sp: bool = MISSING
    """Sequence parallelism (needs tp > 1)."""
    ep: int = ranged(MISSING, at_least(1))
    """Expert parallel size (MoE models), inside each pipeline stage."""
    pp: int = ranged(MISSING, at_least(1))
    """Pipeline parallel size: stages of consecutive layers. Data parallel size is
    world / (tp * pp)."""
    vpp: int | None = ranged(MISSING, at_least(1, optional=True))
    """Virtual pipeline stages (model chunks) per pipeline rank, for the interleaved
    schedule; null: one. Needs pp > 1 and model.num_layers divisible by pp * vpp."""


@dataclasses.dataclass
class TrainerSettings:
    max_steps: int | None = ranged(MISSING, at_least(1, optional=True))
    """Stop after this many trainer steps even if jobs remain (null: when all jobs finish).
    Jobs cut short are exported as they are, marked unfinished; to shorten every job with
    complete schedules, use steps_per_job."""
    steps_per_job: int | None = ranged(MISSING, at_least(1, optional=True))
    """Every job's step budget, replacing each job's max_steps/epochs (null: each job's own):
    a quick run whose learning-rate schedules still complete."""
    micro_batch_tokens: int = ranged(MISSING, at_least(1))
    """Token budget of one packed micro-batch (sequence x batch) per data-parallel rank."""
    max_seq_len: int = ranged(MISSING, at_least(2))
    """Longer samples are truncated (prompt first)."""
    precision: str = ranged(MISSING, one_of("fp32", "bf16"))
    """fp32, or bf16 (bf16 model and adapters, fp32 adapter master weights and optimizer)."""
    cpu_base_gemms: str = ranged(MISSING, one_of("fp32", "bf16", "auto"))
    """On CPU, with precision fp32: the frozen base's GEMMs in fp32, or in bf16 (inputs and
    weights rounded to bf16, fp32 results; adapters, norms, attention, loss and optimizer stay
    fp32), or auto: bf16 where the CPU multiplies bf16 in hardware (AMX), else fp32. Ignored
    on CUDA, where precision decides."""
    cuda_graphs: bool = MISSING
    """On a GPU: each training micro-batch length's forward and backward captured once as
    CUDA graphs and replayed (micro-batches padded to the token budget or its half, quarter
    or eighth). Needs bf16, no tensor/pipeline/expert parallelism, a dense model, no dropout
    and no recompute; refused on CPU."""
    recompute: str | None = ranged(MISSING, one_of(None, "full", "selective"))
    """Activation recompute: null, "full" (every layer) or "selective" (core attention/MoE)."""
    max_bad_steps: int = ranged(MISSING, at_least(1))
    """A job whose loss or gradients are non-finite this many steps in a row is stopped."""
    log_interval: int = ranged(MISSING, at_least(1))
    eval_interval: int = ranged(MISSING, at_least(0))
    """Trainer steps between evaluations of the active jobs; 0: none during training."""
    eval_samples: int = ranged(MISSING, at_least(0))
    """Held-out samples per job for eval loss and generation accuracy (0: no evaluation)."""
    max_new_tokens: int = ranged(MISSING, at_least(0))
    """Generation length for the exact-match accuracy (0: no generations)."""
    queue_jobs: bool = MISSING
    """False: refuse configs with more jobs than slots (or active_jobs) instead of queueing
    them."""
    active_jobs: int | None = ranged(MISSING, at_least(1, optional=True))
    """Jobs training at once (null: lora.slots). Above lora.slots, the jobs take turns by
    step in the lora.slots device slots, each stepping with its own batch size and
    schedule; between turns an adapter (weights, optimizer state) waits in host memory."""
    serve: bool = MISSING
    """True: keep running when every job has ended, admitting jobs submitted with ``mmlora
    submit`` until ``mmlora stop`` (or a signal); the config's adapters may be empty."""
    serve_poll_seconds: float = ranged(MISSING, positive())
    """How often an idle serving trainer looks for submissions (it sleeps in between)."""


@dataclasses.dataclass
class LoggingSettings:
    wandb_mode: str = ranged(MISSING, one_of("offline", "online", "disabled"))
    """offline (no account or network), online, or disabled."""
    wandb_project: str = MISSING
    plots: bool = MISSING
    """PNG loss curves and the adapter x task heat map at the end of the run."""


@dataclasses.dataclass
class CheckpointSettings:
    save_interval: int | None = ranged(MISSING, at_least(0, optional=True))
    """Save every this many trainer steps (and at the end); 0 or null: only at the end."""
    keep_last: int = ranged(MISSING, at_least(0))
    """Checkpoints kept (the newest); 0: all."""
    resume: str = MISSING
    """auto (latest checkpoint in run_dir if any), never, or a checkpoint folder."""


@dataclasses.dataclass
class APISettings:
    """The Tinker-compatible training service (``mmlora api``): clients of the ``tinker``
    SDK train and sample adapters on this run's model instead of the config's jobs."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = ranged(8000, within(1, 65535))
    keys_file: str | None = None
    """API keys, one per line ('tml-...'); null: the MMLORA_API_KEYS variable (comma-
    separated). There is no default key."""
    model_name: str | None = None
    """The base model's name clients ask for (null: hf_dir's folder name, or 'tiny')."""
    batch_window_ms: float = ranged(20.0, at_least(0.0))
    """How long a ready call waits for other clients' calls to join its batch."""
    session_timeout_s: float = ranged(120.0, at_least(20.0))
    """A client silent this long (no heartbeat: crashed or disconnected) frees its slot; at
    least 20 s: the SDK heartbeats every 10 s."""
    max_pending: int = ranged(256, at_least(1))
    """Calls that may wait for the engine (each API key its share); beyond it the service
    answers 429."""
    max_training_clients: int = ranged(256, at_least(1))
    """Training clients held at once: lora.slots of them in device slots, the others' adapters
    and optimizer state paged to host memory until their next call; beyond it a creation is
    answered 429."""
    paged_adapters_mb: float | None = ranged(None, positive(optional=True))
    """Host memory for the paged-out clients' adapters and optimizer state (null: half the
    memory available when the service starts). Where max_training_clients' pages would not
    fit, it holds fewer clients: lora.slots plus as many pages as fit."""
    max_saves: int = ranged(1000, at_least(1))
    """Checkpoints one API key may keep (save_state, save_weights_for_sampler with a path);
    beyond it a save is refused until it deletes some or they expire (ttl_seconds)."""
    max_sessions: int = ranged(1024, at_least(1))
    """Sessions one API key may hold open (each SDK ServiceClient opens one; they end when
    closed or silent for session_timeout_s); beyond it create_session is answered 429."""
    max_samplers: int = ranged(64, at_least(1))
    """Sampling clients of saved weights or of the base one API key may hold; beyond it a
    creation is refused until a session ends."""
    kept_results_mb: float = ranged(256.0, positive())
    """Results of finished calls kept for the SDK to fetch (each up to 10 minutes), all keys
    together: past it the oldest fetched-or-not results go first."""
    recorded_samples_mb: float = ranged(1024.0, positive())
    """Samples drawn with record_stability_info kept for stable_reinforce's provenance, all
    sessions together: past it the largest session's oldest samples go first."""
    recorded_samples_per_session: int = ranged(65536, at_least(1))
    """Of those, the most one session keeps (its oldest go first)."""


@dataclasses.dataclass
class RunConfig:
    model: GPTModelConfig = dataclasses.field(default_factory=GPTModelConfig)
    hf_dir: str | None = MISSING
    """A Hugging Face model folder (config.json, safetensors, tokenizer) to fine-tune: the
    model's architecture, weights and tokenizer come from it and ``model`` is ignored;
    adapters are also exported in PEFT format. null: ``model`` is built from scratch with the
    built-in byte tokenizer."""
    lora: LoRASettings = dataclasses.field(default_factory=LoRASettings)
    adapters: list[AdapterJob] = dataclasses.field(default_factory=list)
    parallel: ParallelSettings = dataclasses.field(default_factory=ParallelSettings)
    trainer: TrainerSettings = dataclasses.field(default_factory=TrainerSettings)
    logging: LoggingSettings = dataclasses.field(default_factory=LoggingSettings)
    checkpoint: CheckpointSettings = dataclasses.field(default_factory=CheckpointSettings)
    api: APISettings = dataclasses.field(default_factory=APISettings)
    run_dir: str = MISSING
    """Where metrics, checkpoints, exported adapters and plots go."""
    data_dir: str = MISSING
    """Folder the default adapter jobs read (scripts/make_demo_data.py writes it)."""
    seed: int = ranged(MISSING, at_least(0))


def load_run_config(cfg: DictConfig | dict) -> RunConfig:
    """Merge a composed config onto the schema; unknown keys, bad types and missing values
    raise ConfigError naming the full key (e.g. ``adapters.0.rank``)."""
    try:
        plain = OmegaConf.to_container(
            OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg, resolve=True
        )
    except OmegaConfBaseException as err:
        raise ConfigError(f"invalid configuration: {_key(err)}{err.msg}") from None
    jobs = plain.pop("adapters", []) or []
    if not isinstance(jobs, list):
        raise ConfigError(f"invalid configuration: adapters: expected a list of jobs, got {jobs!r}")
    run = _merge(RunConfig, plain, "")
    # Merged one by one so that an error names the job (OmegaConf names only the field).
    run.adapters = [_merge(AdapterJob, job, f"adapters.{i}") for i, job in enumerate(jobs)]
    return run


def _merge(schema: type, values: Any, where: str) -> Any:
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))
    except OmegaConfBaseException as err:
        raise ConfigError(f"invalid configuration: {_key(err, where)}{err.msg}") from None


def adapter_job(values: Any, where: str) -> AdapterJob:
    """One ``adapters`` entry from plain values (e.g. a submitted job), type-checked as the
    config is: ConfigError names the field."""
    return _merge(AdapterJob, values, where)


def _key(err: OmegaConfBaseException, where: str = "") -> str:
    key = ".".join(k for k in (where, str(err.full_key or "")) if k)
    return f"{key}: " if key else ""


def job_alpha(job: AdapterJob) -> float:
    """The alpha a job trains with (see ``AdapterJob.alpha``)."""
    if job.alpha is not None:
        return job.alpha
    saved = declared_rank_alpha(job.init_from) if job.init_from else None
    return saved[1] if saved is not None else 2.0 * job.rank


def base_model_config(run: RunConfig) -> GPTModelConfig:
    """The base model's architecture: ``hf_dir``'s config.json, else ``run.model``."""
    if run.hf_dir is None:
        return run.model
    from megatron_multilora.models.hf_config import hf_to_model_config, read_hf_config

    return hf_to_model_config(read_hf_config(run.hf_dir))


def to_plain(run: RunConfig) -> dict[str, Any]:
    """The config as plain data (for run records and wandb)."""
    return dataclasses.asdict(run)

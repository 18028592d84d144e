"""The training run's configuration schema and its validation.

Hydra composes YAML from ``conf/``; :func:`load_run_config` merges it onto these dataclasses
(unknown keys and wrong types fail there, named by their full key) and :func:`validate`
collects every remaining problem, including dataset files, and raises once — before any
process-group work. Each field is documented once, here; its default value is given once, in
``conf/`` (the run-wide settings have none here), except per-job fields (``AdapterJob``) and
model fields, whose defaults are here and which ``conf/`` files set as they choose.

This module imports neither torch nor megatron (seconds to load), so a bad config is reported
at once and `mmlora submit` checks a job without that wait.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_multilora.checkpoint.adapter_folders import (
    FolderFormat,
    declared_rank_alpha,
    folder_format,
)
from megatron_multilora.models.gpt_config import GPTModelConfig

SCHEDULES = ("constant", "linear", "cosine")
# A job's name becomes a file name (its adapter folder, serve/submitted/<name>.json).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class ConfigError(ValueError):
    """A configuration a run cannot start with; the message lists every problem."""


@dataclasses.dataclass
class AdapterJob:
    """One fine-tuning job: an adapter trained on its own data with its own hyperparameters."""

    name: str = MISSING
    dataset: str = MISSING
    """Training JSONL: {"prompt", "completion"} or {"messages": [...]} per line."""
    eval_dataset: Optional[str] = None
    """Held-out JSONL for eval loss (and accuracy of greedy generations); without it the job
    is left out of evaluations and of the end-of-run adapter x task table."""
    rank: int = 16
    alpha: Optional[float] = None
    """LoRA alpha (scale alpha / rank). null: the init_from adapter's own alpha (a PEFT rsLoRA
    alpha converted to the same scale), else 2 * rank. A value that differs from the
    init_from adapter's is refused."""
    dropout: float = 0.0
    """Dropout on this adapter's LoRA input."""
    lr: float = 1e-3
    warmup_steps: int = 0
    schedule: str = "cosine"
    """constant, linear or cosine decay after warmup, down to min_lr_ratio * lr."""
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    grad_clip: Optional[float] = 1.0
    """Clip this adapter's gradient norm; null disables clipping."""
    global_batch_size: int = 8
    """Samples per optimizer step, over all data-parallel ranks."""
    max_steps: Optional[int] = None
    """Optimizer steps to train; or give epochs (trainer.steps_per_job overrides both)."""
    epochs: Optional[float] = None
    start_step: int = 0
    """Trainer step from which the job may take a slot (it waits in the queue until then)."""
    init_from: Optional[str] = None
    """An adapter folder to start from instead of a fresh initialisation: one this trainer
    exported, or a Hugging Face PEFT LoRA folder (rank padded up to lora.max_rank). The job's
    rank must be the adapter's; its alpha is the adapter's (see alpha)."""


@dataclasses.dataclass
class LoRASettings:
    slots: int = MISSING
    """Adapter slots trained at once; more jobs than slots wait in a queue."""
    max_rank: int = MISSING
    """Every slot is allocated at this rank; a job's rank may be lower."""
    targets: list[str] = MISSING
    """Linears to wrap: names or wildcards (linear_qkv, linear_proj, linear_fc1, linear_fc2)."""
    column_init_method: str = MISSING
    row_init_method: str = MISSING
    """zero (default) leaves the base model unchanged until the adapter trains."""
    fully_sharded: bool = MISSING
    """Under tensor parallelism, shard every LoRA factor over the TP ranks (S-LoRA layout:
    adapter memory, optimizer state and LoRA GEMMs divide by parallel.tp). Needs max_rank
    divisible by parallel.tp."""


@dataclasses.dataclass
class ParallelSettings:
    tp: int = MISSING
    """Tensor parallel size."""
    sp: bool = MISSING
    """Sequence parallelism (needs tp > 1)."""
    ep: int = MISSING
    """Expert parallel size (MoE models), inside each pipeline stage."""
    pp: int = MISSING
    """Pipeline parallel size: stages of consecutive layers. Data parallel size is
    world / (tp * pp)."""
    vpp: Optional[int] = MISSING
    """Virtual pipeline stages (model chunks) per pipeline rank, for the interleaved
    schedule; null: one. Needs pp > 1 and model.num_layers divisible by pp * vpp."""


@dataclasses.dataclass
class TrainerSettings:
    max_steps: Optional[int] = MISSING
    """Stop after this many trainer steps even if jobs remain (null: when all jobs finish).
    Jobs cut short are exported as they are, marked unfinished; to shorten every job with
    complete schedules, use steps_per_job."""
    steps_per_job: Optional[int] = MISSING
    """Every job's step budget, replacing each job's max_steps/epochs (null: each job's own):
    a quick run whose learning-rate schedules still complete."""
    micro_batch_tokens: int = MISSING
    """Token budget of one packed micro-batch (sequence x batch) per data-parallel rank."""
    max_seq_len: int = MISSING
    """Longer samples are truncated (prompt first)."""
    precision: str = MISSING
    """fp32, or bf16 (bf16 model and adapters, fp32 adapter master weights and optimizer)."""
    recompute: Optional[str] = MISSING
    """Activation recompute: null, "full" (every layer) or "selective" (core attention/MoE)."""
    max_bad_steps: int = MISSING
    """A job whose loss or gradients are non-finite this many steps in a row is stopped."""
    log_interval: int = MISSING
    eval_interval: int = MISSING
    """Trainer steps between evaluations of the active jobs; 0: none during training."""
    eval_samples: int = MISSING
    """Held-out samples per job for eval loss and generation accuracy."""
    max_new_tokens: int = MISSING
    """Generation length for the exact-match accuracy."""
    queue_jobs: bool = MISSING
    """False: refuse configs with more jobs than slots instead of queueing them."""
    serve: bool = MISSING
    """True: keep running when every job has ended, admitting jobs submitted with ``mmlora
    submit`` until ``mmlora stop`` (or a signal); the config's adapters may be empty."""
    serve_poll_seconds: float = MISSING
    """How often an idle serving trainer looks for submissions (it sleeps in between)."""


@dataclasses.dataclass
class LoggingSettings:
    wandb_mode: str = MISSING
    """offline (no account or network), online, or disabled."""
    wandb_project: str = MISSING
    plots: bool = MISSING
    """PNG loss curves and the adapter x task heat map at the end of the run."""


@dataclasses.dataclass
class CheckpointSettings:
    save_interval: Optional[int] = MISSING
    """Save every this many trainer steps (and at the end); null: only at the end."""
    keep_last: int = MISSING
    resume: str = MISSING
    """auto (latest checkpoint in run_dir if any), never, or a checkpoint folder."""


@dataclasses.dataclass
class RunConfig:
    model: GPTModelConfig = dataclasses.field(default_factory=GPTModelConfig)
    hf_dir: Optional[str] = MISSING
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
    run_dir: str = MISSING
    """Where metrics, checkpoints, exported adapters and plots go."""
    data_dir: str = MISSING
    """Folder the default adapter jobs read (scripts/make_demo_data.py writes it)."""
    seed: int = MISSING


def load_run_config(cfg: DictConfig | dict) -> RunConfig:
    """Merge a composed config onto the schema; unknown keys, bad types and missing values
    raise ConfigError naming the full key (e.g. ``adapters.0.rank``)."""
    try:
        plain = OmegaConf.to_container(OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg,
                                       resolve=True)
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


def world_size() -> int:
    """The launch's world size, known from torchrun's environment before any process group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def validate(run: RunConfig, check_files: bool = True) -> None:
    """Raise ConfigError listing every problem with ``run`` for this launch's world size."""
    problems: list[str] = []
    world, par, tr = world_size(), run.parallel, run.trainer
    if min(par.tp, par.ep, par.pp, par.vpp or 1) < 1:
        problems.append(f"parallel.tp={par.tp}, parallel.ep={par.ep}, parallel.pp={par.pp} and "
                        f"parallel.vpp={par.vpp} must be at least 1")
    elif world % (par.tp * par.pp):
        problems.append(f"parallel.tp={par.tp} x parallel.pp={par.pp} must divide the world size "
                        f"{world}")
    elif (world // par.pp) % par.ep:  # megatron's expert grid lies within each stage
        problems.append(f"parallel.ep={par.ep} must divide the {world // par.pp} processes of "
                        f"each pipeline stage (world size {world} / parallel.pp={par.pp})")
    if par.sp and par.tp == 1:
        problems.append("parallel.sp=true needs parallel.tp > 1")
    if par.vpp is not None and par.pp == 1:
        problems.append(f"parallel.vpp={par.vpp} needs parallel.pp > 1; without pipelining use "
                        "parallel.vpp=null")
    if run.lora.fully_sharded and run.lora.max_rank % max(par.tp, 1):
        problems.append(f"lora.fully_sharded=true splits the rank over parallel.tp={par.tp} ranks: "
                        f"lora.max_rank={run.lora.max_rank} must be a multiple of it")
    model = run.model
    try:
        model = base_model_config(run)
    except (OSError, ValueError) as err:
        problems.append(f"hf_dir: {err}")
    problems += [f"model: {p}" for p in model.check(max(par.tp, 1), max(par.pp, 1),
                                                    par.vpp if (par.vpp or 0) >= 1 else None)]
    if model.num_moe_experts is None and par.ep > 1:
        problems.append("parallel.ep > 1 needs a MoE model (model.num_moe_experts)")
    if model.num_moe_experts and model.num_moe_experts % par.ep:
        problems.append(f"model.num_moe_experts={model.num_moe_experts} is not divisible by "
                        f"parallel.ep={par.ep}")
    if tr.precision not in ("fp32", "bf16"):
        problems.append(f"trainer.precision={tr.precision!r}: use fp32 or bf16")
    if tr.recompute not in (None, "full", "selective"):
        problems.append(f"trainer.recompute={tr.recompute!r}: use null, full or selective")
    if tr.max_seq_len > tr.micro_batch_tokens:
        problems.append(f"trainer.max_seq_len={tr.max_seq_len} exceeds trainer.micro_batch_tokens="
                        f"{tr.micro_batch_tokens}")
    if tr.max_seq_len > model.max_sequence_length:
        problems.append(f"trainer.max_seq_len={tr.max_seq_len} exceeds model.max_sequence_length="
                        f"{model.max_sequence_length}")
    if tr.steps_per_job is not None and tr.steps_per_job < 1:
        problems.append(f"trainer.steps_per_job={tr.steps_per_job} must be at least 1 (or null)")
    if run.logging.wandb_mode not in ("offline", "online", "disabled"):
        problems.append(f"logging.wandb_mode={run.logging.wandb_mode!r}: use offline, online or "
                        "disabled")
    if not run.adapters and not tr.serve:
        problems.append("adapters: no adapter jobs configured (or set trainer.serve=true and "
                        "submit jobs with mmlora submit)")
    if tr.serve_poll_seconds <= 0:
        problems.append(f"trainer.serve_poll_seconds={tr.serve_poll_seconds} must be positive")
    if not tr.queue_jobs and len(run.adapters) > run.lora.slots:
        problems.append(f"{len(run.adapters)} adapter jobs but lora.slots={run.lora.slots} and "
                        "trainer.queue_jobs=false")
    names = [job.name for job in run.adapters]
    if len(set(names)) != len(names):
        problems.append(f"adapter names must be unique: {names}")
    for i, name in enumerate(names):
        problems += name_problems(name, f"adapters.{i}")
    dp = max(world // max(par.tp * par.pp, 1), 1)
    for i, job in enumerate(run.adapters):
        problems += job_problems(job, f"adapters.{i} ({job.name})", run.lora.max_rank, dp,
                                 check_files)
    if problems:
        raise ConfigError("the run cannot start:\n  - " + "\n  - ".join(problems))


def name_problems(name: str, where: str) -> list[str]:
    """What is wrong with a job's name on its own (config and submitted jobs)."""
    if not _NAME.fullmatch(name):
        return [f"{where}: name={name!r}: use letters, digits, '.', '_' and '-', starting with a "
                "letter or digit (the name becomes a file name)"]
    if name == "base":  # the final tables' row of the base model alone
        return [f"{where}: the name 'base' is reserved for the base model's row in the final "
                "tables; choose another name"]
    return []


def job_problems(job: AdapterJob, where: str, max_rank: int, dp: int,
                 check_files: bool = True) -> list[str]:
    """What is wrong with one adapter job on a run of ``max_rank`` slots and ``dp``
    data-parallel ranks, each problem prefixed with ``where`` (config and submitted jobs)."""
    from megatron_multilora.data.datasets import DatasetError, read_jsonl_records

    problems = []
    if not 1 <= job.rank <= max_rank:
        problems.append(f"{where}: rank={job.rank} is outside 1..lora.max_rank={max_rank}")
    if (job.alpha is not None and job.alpha <= 0) or job.lr <= 0:
        problems.append(f"{where}: alpha and lr must be positive")
    if not 0.0 <= job.dropout < 1.0:
        problems.append(f"{where}: dropout={job.dropout} must be in [0, 1)")
    if job.schedule not in SCHEDULES:
        problems.append(f"{where}: schedule={job.schedule!r}: choose one of {SCHEDULES}")
    if job.global_batch_size < dp or job.global_batch_size % dp:
        problems.append(f"{where}: global_batch_size={job.global_batch_size} must be a multiple "
                        f"of the data-parallel size {dp}")
    if (job.max_steps is None) == (job.epochs is None):
        problems.append(f"{where}: give exactly one of max_steps and epochs")
    if check_files:
        for field in ("dataset", "eval_dataset"):
            path = getattr(job, field)
            if path is None:
                continue
            try:
                read_jsonl_records(path)
            except DatasetError as err:
                problems.append(f"{where}.{field}: {err}")
        if job.init_from is not None and not os.path.isdir(job.init_from):
            problems.append(f"{where}.init_from: {job.init_from} is not a folder")
        elif job.init_from is not None:
            problems += [f"{where}: {p}" for p in _init_from_problems(job)]
    return problems


def _init_from_problems(job: AdapterJob) -> list[str]:
    """The folder must hold an adapter (either format), and a started adapter keeps its rank
    and alpha: the job must not state others."""
    try:
        found = folder_format(job.init_from)
    except (OSError, ValueError) as err:
        return [f"init_from: {err}"]
    if found is FolderFormat.TRAINING_CHECKPOINT:
        return [f"init_from {job.init_from} is {found.value}, not an adapter folder; start from "
                "an exported one (<run_dir>/adapters/<name> or <run_dir>/peft/<name>)"]
    saved = declared_rank_alpha(job.init_from)
    if saved is None:
        return [f"init_from {job.init_from}: its adapter_config.json does not declare a rank "
                "and alpha"]
    rank, alpha = saved
    problems = []
    if rank != job.rank:
        problems.append(f"init_from {job.init_from} holds a rank-{rank} adapter but rank="
                        f"{job.rank}; set rank={rank} (a started adapter keeps its rank)")
    # The saved alpha went through float32: equal up to that precision is the same alpha.
    if job.alpha is not None and not math.isclose(job.alpha, alpha, rel_tol=1e-6):
        problems.append(f"init_from {job.init_from} holds an adapter with alpha={alpha:.7g} but "
                        f"alpha={job.alpha:g}; set alpha={alpha:.7g} or leave alpha unset (a "
                        "started adapter keeps its scale)")
    return problems


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

"""The training run's configuration schema and its validation.

Hydra composes YAML from ``conf/``; :func:`load_run_config` merges it onto these dataclasses
(unknown keys and wrong types fail there) and :func:`validate` collects every remaining
problem, including dataset files, and raises once — before any process-group work.
Each field is documented once, here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_multilora.models.gpt import GPTModelConfig

SCHEDULES = ("constant", "linear", "cosine")


class ConfigError(ValueError):
    """A configuration a run cannot start with; the message lists every problem."""


@dataclasses.dataclass
class AdapterJob:
    """One fine-tuning job: an adapter trained on its own data with its own hyperparameters."""

    name: str = MISSING
    dataset: str = MISSING
    """Training JSONL: {"prompt", "completion"} or {"messages": [...]} per line."""
    eval_dataset: Optional[str] = None
    """Held-out JSONL for eval loss (and accuracy of greedy generations)."""
    rank: int = 16
    alpha: float = 32.0
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
    """Optimizer steps to train; or give epochs."""
    epochs: Optional[float] = None
    start_step: int = 0
    """Trainer step from which the job may take a slot (it waits in the queue until then)."""
    init_from: Optional[str] = None
    """An adapter folder to start from instead of a fresh initialisation: one this trainer
    exported, or a Hugging Face PEFT LoRA folder (rank padded up to lora.max_rank)."""


@dataclasses.dataclass
class LoRASettings:
    slots: int = 4
    """Adapter slots trained at once; more jobs than slots wait in a queue."""
    max_rank: int = 16
    """Every slot is allocated at this rank; a job's rank may be lower."""
    targets: list[str] = dataclasses.field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    column_init_method: str = "xavier"
    row_init_method: str = "zero"
    fully_sharded: bool = False
    """Under tensor parallelism, shard every LoRA factor over the TP ranks (S-LoRA layout:
    adapter memory, optimizer state and LoRA GEMMs divide by parallel.tp). Needs max_rank
    divisible by parallel.tp."""


@dataclasses.dataclass
class ParallelSettings:
    tp: int = 1
    """Tensor parallel size."""
    sp: bool = False
    """Sequence parallelism (needs tp > 1)."""
    ep: int = 1
    """Expert parallel size (MoE models). Data parallel size is world / tp."""


@dataclasses.dataclass
class TrainerSettings:
    max_steps: Optional[int] = None
    """Stop after this many trainer steps even if jobs remain (null: when all jobs finish)."""
    micro_batch_tokens: int = 1024
    """Token budget of one packed micro-batch (sequence x batch) per data-parallel rank."""
    max_seq_len: int = 256
    """Longer samples are truncated (prompt first)."""
    precision: str = "fp32"
    """fp32, or bf16 (bf16 model and adapters, fp32 adapter master weights and optimizer)."""
    recompute: Optional[str] = None
    """Activation recompute: null, "full" (every layer) or "selective" (core attention/MoE)."""
    max_bad_steps: int = 3
    """A job whose loss or gradients are non-finite this many steps in a row is stopped."""
    log_interval: int = 10
    eval_interval: int = 50
    eval_samples: int = 32
    """Held-out samples per job for eval loss and generation accuracy."""
    max_new_tokens: int = 16
    queue_jobs: bool = True
    """False: refuse configs with more jobs than slots instead of queueing them."""


@dataclasses.dataclass
class LoggingSettings:
    wandb_mode: str = "offline"
    """offline (default: no account or network), online, or disabled."""
    wandb_project: str = "megatron-multilora"
    plots: bool = True
    """PNG loss curves and the adapter x task heat map at the end of the run."""


@dataclasses.dataclass
class CheckpointSettings:
    save_interval: Optional[int] = 100
    """Save every this many trainer steps (and at the end); null: only at the end."""
    keep_last: int = 2
    resume: str = "auto"
    """auto (latest checkpoint in run_dir if any), never, or a checkpoint folder."""


@dataclasses.dataclass
class RunConfig:
    model: GPTModelConfig = dataclasses.field(default_factory=GPTModelConfig)
    hf_dir: Optional[str] = None
    """A Hugging Face model folder (config.json, safetensors, tokenizer) to fine-tune: the
    model's architecture, weights and tokenizer come from it and ``model`` is ignored;
    adapters are also exported in PEFT format. Without it, ``model`` is built from scratch
    with the built-in byte tokenizer."""
    lora: LoRASettings = dataclasses.field(default_factory=LoRASettings)
    adapters: list[AdapterJob] = dataclasses.field(default_factory=list)
    parallel: ParallelSettings = dataclasses.field(default_factory=ParallelSettings)
    trainer: TrainerSettings = dataclasses.field(default_factory=TrainerSettings)
    logging: LoggingSettings = dataclasses.field(default_factory=LoggingSettings)
    checkpoint: CheckpointSettings = dataclasses.field(default_factory=CheckpointSettings)
    run_dir: str = "runs/default"
    """Where metrics, checkpoints, exported adapters and plots go."""
    data_dir: str = "data/demo"
    """Folder the default adapter jobs read (scripts/make_demo_data.py writes it)."""
    seed: int = 1234


def load_run_config(cfg: DictConfig | dict) -> RunConfig:
    """Merge a composed config onto the schema; unknown keys and bad types raise ConfigError."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        raise ConfigError(f"invalid configuration: {err}") from None


def world_size() -> int:
    """The launch's world size, known from torchrun's environment before any process group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def validate(run: RunConfig, check_files: bool = True) -> None:
    """Raise ConfigError listing every problem with ``run`` for this launch's world size."""
    from megatron_multilora.data.datasets import DatasetError, read_jsonl_records

    problems: list[str] = []
    world, par, tr = world_size(), run.parallel, run.trainer
    if par.tp < 1 or par.ep < 1 or world % par.tp or world % par.ep:
        problems.append(f"parallel.tp={par.tp} and parallel.ep={par.ep} must divide the world "
                        f"size {world}")
    if par.sp and par.tp == 1:
        problems.append("parallel.sp=true needs parallel.tp > 1")
    if run.lora.fully_sharded and run.lora.max_rank % max(par.tp, 1):
        problems.append(f"lora.fully_sharded=true splits the rank over parallel.tp={par.tp} ranks: "
                        f"lora.max_rank={run.lora.max_rank} must be a multiple of it")
    if run.model.num_moe_experts is None and par.ep > 1:
        problems.append("parallel.ep > 1 needs a MoE model (model.num_moe_experts)")
    if run.hf_dir is not None:
        try:
            run.model = hf_model_config(run.hf_dir)
        except (OSError, ValueError) as err:
            problems.append(f"hf_dir: {err}")
    problems += [f"model: {p}" for p in run.model.check(max(par.tp, 1))]
    if run.model.num_moe_experts and run.model.num_moe_experts % par.ep:
        problems.append(f"model.num_moe_experts={run.model.num_moe_experts} is not divisible by "
                        f"parallel.ep={par.ep}")
    if tr.precision not in ("fp32", "bf16"):
        problems.append(f"trainer.precision={tr.precision!r}: use fp32 or bf16")
    if tr.recompute not in (None, "full", "selective"):
        problems.append(f"trainer.recompute={tr.recompute!r}: use null, full or selective")
    if tr.max_seq_len > tr.micro_batch_tokens:
        problems.append(f"trainer.max_seq_len={tr.max_seq_len} exceeds trainer.micro_batch_tokens="
                        f"{tr.micro_batch_tokens}")
    if tr.max_seq_len > run.model.max_sequence_length:
        problems.append(f"trainer.max_seq_len={tr.max_seq_len} exceeds model.max_sequence_length="
                        f"{run.model.max_sequence_length}")
    if run.logging.wandb_mode not in ("offline", "online", "disabled"):
        problems.append(f"logging.wandb_mode={run.logging.wandb_mode!r}: use offline, online or "
                        "disabled")
    if not run.adapters:
        problems.append("adapters: no adapter jobs configured")
    if not tr.queue_jobs and len(run.adapters) > run.lora.slots:
        problems.append(f"{len(run.adapters)} adapter jobs but lora.slots={run.lora.slots} and "
                        "trainer.queue_jobs=false")
    names = [job.name for job in run.adapters]
    if len(set(names)) != len(names):
        problems.append(f"adapter names must be unique: {names}")
    dp = world // max(par.tp, 1)
    for i, job in enumerate(run.adapters):
        where = f"adapters.{i} ({job.name})"
        if not 1 <= job.rank <= run.lora.max_rank:
            problems.append(f"{where}: rank={job.rank} is outside 1..lora.max_rank={run.lora.max_rank}")
        if job.alpha <= 0 or job.lr <= 0:
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
                saved = _saved_adapter_rank(job.init_from)
                if saved is not None and saved != job.rank:
                    problems.append(f"{where}: init_from {job.init_from} holds a rank-{saved} "
                                    f"adapter but rank={job.rank}; set rank={saved} (a "
                                    "started adapter keeps its rank)")
    if problems:
        raise ConfigError("the run cannot start:\n  - " + "\n  - ".join(problems))


def _saved_adapter_rank(folder: str) -> Optional[int]:
    """The rank in an adapter folder's config (this project's or PEFT's), if readable."""
    import json

    try:
        config = json.loads(open(os.path.join(folder, "adapter_config.json")).read())
    except (OSError, ValueError):
        return None  # the import names what is wrong with the folder
    rank = config.get("rank", config.get("r"))
    return rank if isinstance(rank, int) else None


def hf_model_config(folder: str) -> GPTModelConfig:
    """The model config a Hugging Face folder's ``config.json`` describes."""
    from megatron_multilora.models.hf_config import hf_to_model_config, read_hf_config

    return hf_to_model_config(read_hf_config(folder))


def to_plain(run: RunConfig) -> dict[str, Any]:
    """The config as plain data (for run records and wandb)."""
    return dataclasses.asdict(run)

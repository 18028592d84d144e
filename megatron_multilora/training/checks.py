"""The config check: every problem with a run's config, found at once, in seconds, before
anything is built or written. Every setting's range (the rules on the schema's fields), the
parallel layout against the launch's world size and the model's shape against it
(:mod:`megatron_multilora.validation`, the rules shared with ``init_parallel`` and the model
builder), the base model folder, the run directory, the checkpoint to resume, and each job:
its name, budget, batch, rank, data files and ``init_from`` adapter. The same per-job checks
serve ``mmlora submit`` and the trainer's re-check of a submission.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from pathlib import Path

from megatron_multilora.checkpoint.adapter_folders import (
    CHECKPOINT_STATE,
    FolderFormat,
    declared_rank_alpha,
    folder_format,
)
from megatron_multilora.models.gpt_config import GPTModelConfig
from megatron_multilora.models.mla_config import mla_layout_problems
from megatron_multilora.training.config import (
    AdapterJob,
    ConfigError,
    RunConfig,
    base_model_config,
)
from megatron_multilora.training.objectives.objective import Objective
from megatron_multilora.training.objectives.registry import JOB_OBJECTIVES
from megatron_multilora.validation import (
    CONFIG_NAMES,
    TARGET_NAMES,
    layout_problems,
    model_layout_problems,
    schema_problems,
)

# A job's name becomes a file name (its adapter folder, serve/submitted/<name>.json).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def world_size() -> int:
    """The launch's world size, known from torchrun's environment before any process group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def validate(run: RunConfig, check_files: bool = True) -> None:
    """Raise ConfigError listing every problem with ``run`` for this launch's world size."""
    world, par, tr = world_size(), run.parallel, run.trainer
    problems = schema_problems(run, skip=("adapters", "model"))  # those: below
    if not problems:  # the layout rules assume sizes of at least 1
        problems += layout_problems(world, par.tp, par.ep, par.pp, par.sp, par.vpp, CONFIG_NAMES)
    if run.lora.fully_sharded and run.lora.max_rank % max(par.tp, 1):
        problems.append(
            f"lora.fully_sharded=true splits the rank over parallel.tp={par.tp} ranks: "
            f"lora.max_rank={run.lora.max_rank} must be a multiple of it"
        )
    if tr.cpu_base_gemms == "bf16" and not _bf16_gemms_run_here():
        problems.append(
            "trainer.cpu_base_gemms=bf16: this CPU has no bf16 GEMMs (oneDNN needs "
            "AVX-512 BF16 or AMX); use fp32, or auto (bf16 where the CPU has AMX "
            "or AVX-512 BF16)"
        )
    problems += _target_problems(run.lora.targets)
    problems += _model_problems(run, check_files)
    if not run.adapters and not tr.serve and not run.api.enabled:
        problems.append(
            "adapters: no adapter jobs configured (or set trainer.serve=true and "
            "submit jobs with mmlora submit)"
        )
    at_once = max(tr.active_jobs or 0, run.lora.slots)
    if not tr.queue_jobs and len(run.adapters) > at_once:
        problems.append(
            f"{len(run.adapters)} adapter jobs but lora.slots={run.lora.slots}"
            f"{f' and trainer.active_jobs={tr.active_jobs}' if tr.active_jobs else ''} and "
            "trainer.queue_jobs=false"
        )
    if tr.active_jobs is not None and tr.active_jobs < run.lora.slots:
        problems.append(
            f"trainer.active_jobs={tr.active_jobs} is below lora.slots={run.lora.slots}: "
            "set it to lora.slots or more (null: lora.slots)"
        )
    names = [job.name for job in run.adapters]
    if len(set(names)) != len(names):
        problems.append(f"adapter names must be unique: {names}")
    dp = max(world // max(par.tp * par.pp, 1), 1)
    for i, job in enumerate(run.adapters):
        problems += name_problems(job.name, f"adapters.{i}.")
        problems += job_problems(
            job,
            f"adapters.{i}.",
            run.lora.max_rank,
            dp,
            tr.max_seq_len,
            check_files,
            tr.cuda_graphs,
        )
    if check_files:
        problems += _run_dir_problems(run.run_dir) + _resume_problems(run)
    if problems:
        raise ConfigError("the run cannot start:\n  - " + "\n  - ".join(problems))


def _bf16_gemms_run_here() -> bool:
    import torch

    from megatron_multilora.ops.packed_linear import bf16_gemms_supported

    return torch.cuda.is_available() or bf16_gemms_supported()


def _target_problems(targets: list[str]) -> list[str]:
    if not targets:
        return ["lora.targets: empty; name the linears to adapt, e.g. [linear_qkv, linear_proj]"]
    problems = []
    for i, target in enumerate(targets):
        if any(c in target for c in "*?[") or target in TARGET_NAMES:
            continue
        close = difflib.get_close_matches(target, TARGET_NAMES, n=1)
        problems.append(
            f"lora.targets.{i}={target!r}: no such linear; "
            f"{f'did you mean {close[0]!r}? ' if close else ''}use one of "
            f"{', '.join(TARGET_NAMES)} or a wildcard pattern over module paths"
        )
    return problems


def _model_problems(run: RunConfig, check_files: bool) -> list[str]:
    """The base model: its folder (when ``hf_dir`` is given), each field's range, its shape
    against the layout, and the trainer's sequence lengths against it."""
    from megatron_multilora.models.hf_folder import folder_problems

    if run.hf_dir is not None and check_files:
        found = folder_problems(run.hf_dir)
        if found:
            return [f"hf_dir: {p}" for p in found]
    try:
        model = base_model_config(run)
    except (OSError, ValueError) as err:
        return [f"hf_dir: {err}"]
    problems = schema_problems(model, "model.")
    if problems:
        return problems
    par, tr = run.parallel, run.trainer
    problems = [
        f"model: {p}" for p in model_layout_problems(model, par.tp, par.pp, par.vpp, par.ep)
    ]
    if model.mla is not None:
        problems += [f"model: {p}" for p in mla_layout_problems(par.tp, par.sp)]
    if model.num_moe_experts is None and par.ep > 1:
        problems.append("parallel.ep > 1 needs a MoE model (model.num_moe_experts)")
    if tr.max_seq_len > tr.micro_batch_tokens:
        problems.append(
            f"trainer.max_seq_len={tr.max_seq_len} exceeds trainer.micro_batch_tokens="
            f"{tr.micro_batch_tokens}"
        )
    if tr.max_seq_len > model.max_sequence_length:
        problems.append(
            f"trainer.max_seq_len={tr.max_seq_len} exceeds model.max_sequence_length="
            f"{model.max_sequence_length}"
        )
    return problems + (_cuda_graph_problems(run, model) if tr.cuda_graphs else [])


def _cuda_graph_problems(run: RunConfig, model: GPTModelConfig) -> list[str]:
    """What ``trainer.cuda_graphs=true`` needs: a GPU, and a pass whose every decision the
    host can make without reading the micro-batch's values (training/step/cuda_graphs.py)."""
    import torch

    from megatron_multilora.models.specs import transformer_engine_usable

    if not torch.cuda.is_available():
        return [
            "trainer.cuda_graphs=true needs a CUDA GPU and this machine has none "
            "(torch.cuda.is_available() is False): set trainer.cuda_graphs=false"
        ]
    par, tr, why = run.parallel, run.trainer, "trainer.cuda_graphs=true needs"
    needs = {
        "trainer.precision=bf16 (the grouped GEMM is one kernel in bf16; fp32 runs a per-slot "
        "loop that reads the group sizes on the host)": tr.precision == "bf16",
        "one GPU per model replica: parallel.tp, pp and ep of 1 (data parallelism is fine)": (
            par.tp == par.pp == par.ep == 1
        ),
        "a dense model (the MoE dispatcher reads per-expert token counts on the host)": (
            model.num_moe_experts is None
        ),
        "trainer.recompute=null (recompute sets the RNG state on the host)": tr.recompute is None,
        "model.attention_dropout and hidden_dropout of 0 (a replay draws no fresh masks)": (
            model.attention_dropout == model.hidden_dropout == 0
        ),
        "model.softmax_type=vanilla (the graphed pass's flash varlen attention has no "
        "sinks)": model.softmax_type == "vanilla",
        "the torch layers (Transformer Engine's are graphed by TE, not checked here)": (
            not transformer_engine_usable()
        ),
        # The bf16 grouped kernel takes widths in multiples of 16 bytes; off them the
        # per-group fallback reads the group sizes on the host, which a capture refuses.
        f"lora.max_rank a multiple of 8 (it is {run.lora.max_rank}: a slot's GEMMs run at "
        "the largest active rank rounded up to 8, at most max_rank)": run.lora.max_rank % 8 == 0,
        "the model's widths in multiples of 8 (hidden_size, ffn_hidden_size, attention heads x "
        "kv_channels) for the bf16 grouped GEMM kernel": _widths_take_the_kernel(model),
    }
    return [f"{why} {need}" for need, met in needs.items() if not met]


def _widths_take_the_kernel(model: GPTModelConfig) -> bool:
    heads, groups = model.num_attention_heads, model.num_query_groups or model.num_attention_heads
    head = model.kv_channels or model.hidden_size // heads
    widths = (model.hidden_size, model.ffn_hidden_size, heads * head, groups * head)
    return all(w % 8 == 0 for w in widths)


def _run_dir_problems(run_dir: str) -> list[str]:
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        return [f"run_dir={run_dir}: is a file, not a folder; choose another run_dir"]
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if not path.exists() and parent is not None and not os.access(parent, os.W_OK):
        return [f"run_dir={run_dir}: cannot be created ({parent} is not writable)"]
    return []


def _resume_problems(run: RunConfig) -> list[str]:
    resume = run.checkpoint.resume
    if resume in ("auto", "never"):
        return []
    path = Path(resume)
    if not path.is_dir():
        close = difflib.get_close_matches(resume, ("auto", "never"), n=1)
        return [
            f"checkpoint.resume={resume!r}: not auto, never, or a checkpoint folder"
            + (f"; did you mean {close[0]!r}?" if close else "")
        ]
    if not (path / CHECKPOINT_STATE).is_file():
        return [
            f"checkpoint.resume={resume}: not a training checkpoint (it has no "
            f"{CHECKPOINT_STATE}); pass one of <run_dir>/checkpoints/step_*, or auto"
        ]
    return []


def name_problems(name: str, where: str) -> list[str]:
    """What is wrong with a job's name on its own (config and submitted jobs); ``where``
    prefixes each problem (``adapters.0.``, or ``<file>: ``)."""
    if not _NAME.fullmatch(name):
        return [
            f"{where}name={name!r}: use letters, digits, '.', '_' and '-', starting with a "
            "letter or digit (the name becomes a file name)"
        ]
    if name == "base":  # the final tables' row of the base model alone
        return [
            f"{where}name='base': reserved for the base model's row in the final tables; "
            "choose another name"
        ]
    return []


def job_problems(
    job: AdapterJob,
    where: str,
    max_rank: int,
    dp: int,
    max_seq_len: int,
    check_files: bool = True,
    cuda_graphs: bool = False,
) -> list[str]:
    """What is wrong with one adapter job on a run of ``max_rank`` slots, ``dp``
    data-parallel ranks and sequences of at most ``max_seq_len`` tokens (under CUDA graphs
    with ``cuda_graphs``): each field's range, then what depends on the run or on several
    fields, then its files (config and submitted jobs). ``where`` prefixes each problem
    (``adapters.0.``, or ``<file>: ``)."""
    problems = schema_problems(job, where)
    if cuda_graphs and job.dropout:
        problems.append(
            f"{where}dropout={job.dropout}: trainer.cuda_graphs=true replays captured passes, "
            "which draw no fresh dropout masks; use dropout 0 (or run without cuda_graphs)"
        )
    if job.rank > max_rank:
        problems.append(f"{where}rank={job.rank}: exceeds lora.max_rank={max_rank}")
    if job.global_batch_size % dp:
        problems.append(
            f"{where}global_batch_size={job.global_batch_size}: must be a multiple "
            f"of the data-parallel size {dp}"
        )
    if (job.max_steps is None) == (job.epochs is None):
        problems.append(
            f"{where}max_steps={job.max_steps}, epochs={job.epochs}: give exactly one of them"
        )
    objective = JOB_OBJECTIVES.get(job.objective)  # None: refused above by its range
    if objective is None:
        return problems
    problems += objective.problems(job, where, max_seq_len)
    return problems + (_file_problems(job, objective, where) if check_files else [])


def _file_problems(job: AdapterJob, objective: type[Objective], where: str) -> list[str]:
    from megatron_multilora.data.datasets import DatasetError, read_records

    problems = []
    for field in ("dataset", "eval_dataset"):
        path = getattr(job, field)
        if path is None:
            continue
        try:
            records = read_records(path, objective.record_form, job.columns)
        except DatasetError as err:
            problems.append(f"{where}{field}: {err}")
            continue
        problems += objective.record_problems(job, field, records, where)
    if job.init_from is not None and not os.path.isdir(job.init_from):
        problems.append(f"{where}init_from={job.init_from}: not a folder")
    elif job.init_from is not None:
        problems += [f"{where}{p}" for p in _init_from_problems(job)]
    return problems


def _init_from_problems(job: AdapterJob) -> list[str]:
    """The folder must hold an adapter (either format), and a started adapter keeps its rank
    and alpha: the job must not state others."""
    try:
        found = folder_format(job.init_from)
    except (OSError, ValueError) as err:
        return [f"init_from: {err}"]
    if found is FolderFormat.TRAINING_CHECKPOINT:
        return [
            f"init_from {job.init_from} is {found.value}, not an adapter folder; start from "
            "an exported one (<run_dir>/adapters/<name> or <run_dir>/peft/<name>)"
        ]
    saved = declared_rank_alpha(job.init_from)
    if saved is None:
        return [
            f"init_from {job.init_from}: its adapter_config.json does not declare a rank and alpha"
        ]
    rank, alpha = saved
    problems = []
    if rank != job.rank:
        problems.append(
            f"init_from {job.init_from} holds a rank-{rank} adapter but rank="
            f"{job.rank}; set rank={rank} (a started adapter keeps its rank)"
        )
    # The saved alpha went through float32: equal up to that precision is the same alpha.
    if job.alpha is not None and not math.isclose(job.alpha, alpha, rel_tol=1e-6):
        problems.append(
            f"init_from {job.init_from} holds an adapter with alpha={alpha:.7g} but "
            f"alpha={job.alpha:g}; set alpha={alpha:.7g} or leave alpha unset (a "
            "started adapter keeps its scale)"
        )
    return problems

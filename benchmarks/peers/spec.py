"""The jobs every way of rows 10 trains: conf/jobs/demo4.yaml's, as the recipe composes them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

WAYS = ("ours", "peft-seq-1t", "peft-seq-2t", "peft-par", "ours-1p")


WAY_TEXT = {
    "ours": "ours: every job in its own slot of one model, trained together, 2 processes x 1 "
    "thread (torchrun, data parallel)",
    "peft-seq-1t": "transformers + peft in one process, the adapters one after another, 1 thread",
    "peft-seq-2t": "transformers + peft in one process, the adapters one after another, 2 threads",
    "peft-par": "2 independent transformers + peft processes at once (1 thread each, 2 adapters "
    "each, one after another)",
    "ours-1p": "ours on one core: every job in its own slot of one model, 1 process x 1 thread",
}


PEFT_WAYS = ("peft-seq-1t", "peft-seq-2t", "peft-par")


def job_spec(
    data_dir: Path, steps: int | None, config_name: str = "config", overrides: Sequence[str] = ()
) -> dict:
    """The recipe's run of ``config_name`` on ``data_dir`` (default: conf/jobs/demo4.yaml's
    jobs on the tiny HF Llama), every job ``steps`` steps (None: each its own ``max_steps``),
    composed and checked as the recipe does: its jobs, the run-wide settings that shape
    training and evaluation, and the HF module names of its LoRA targets."""
    from benchmarks.workloads import recipe_run
    from megatron_multilora.checkpoint.peft_format import hf_module_names
    from megatron_multilora.training.config import to_plain

    overrides = [
        f"data_dir={data_dir}",
        *overrides,
        *([f"trainer.steps_per_job={steps}"] if steps else []),
    ]
    run = recipe_run(overrides, config_name=config_name)
    targets = []
    for target in run.lora.targets:
        rest = {"linear_qkv": "self_attention.", "linear_proj": "self_attention."}.get(
            target, "mlp."
        ) + target
        targets += [part.rsplit(".", 1)[1] for part in hf_module_names(rest, "llama")]
    jobs = to_plain(run)["adapters"]
    for job in jobs:
        job["max_steps"] = steps or job["max_steps"]
    return {
        "config_name": config_name,
        "overrides": overrides,
        "hf_dir": run.hf_dir,
        "jobs": jobs,
        "targets": targets,
        "our_targets": list(run.lora.targets),
        "seed": run.seed,
        "steps": max(job["max_steps"] for job in jobs),
        "max_seq_len": run.trainer.max_seq_len,
        "micro_batch_tokens": run.trainer.micro_batch_tokens,
        "eval_samples": run.trainer.eval_samples,
    }

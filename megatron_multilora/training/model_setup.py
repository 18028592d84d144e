"""The run's model: the frozen base (HF weights when the run names them) with adapter slots."""

from __future__ import annotations

import dataclasses

import torch

from megatron_multilora.layers.inject import apply_multi_lora
from megatron_multilora.models.gpt import build_model_chunks
from megatron_multilora.models.gpt_config import GPTModelConfig
from megatron_multilora.models.hf_import import INIT_FOR_CHECKPOINT, load_hf_checkpoint
from megatron_multilora.ops.packed_linear import bf16_gemms_fast
from megatron_multilora.training.config import RunConfig


def cpu_gemm_dtype(setting: str) -> torch.dtype:
    """The dtype of the frozen base's GEMMs on CPU for ``trainer.cpu_base_gemms``."""
    if setting == "auto":
        setting = "bf16" if bf16_gemms_fast() else "fp32"
    return torch.bfloat16 if setting == "bf16" else torch.float32


def precision_summary(run: RunConfig) -> str:
    """How the run multiplies, for its start line: its precision, and on CPU the dtype of
    the frozen base's GEMMs when it differs."""
    if run.trainer.precision == "bf16":
        return "bf16"
    if (
        not torch.cuda.is_available()
        and cpu_gemm_dtype(run.trainer.cpu_base_gemms) == torch.bfloat16
    ):
        return "fp32, the frozen base's GEMMs in bf16"
    return "fp32"


def build_run_model(run: RunConfig, model_config: GPTModelConfig) -> list[torch.nn.Module]:
    """The model chunks (one per virtual pipeline stage) of ``model_config``'s base, loaded
    from ``run.hf_dir`` when given, wrapped with ``run.lora``'s adapter slots."""
    model_cfg = dataclasses.replace(model_config)  # recompute is a run setting
    if run.trainer.recompute is not None:
        model_cfg.recompute_granularity = run.trainer.recompute
        if run.trainer.recompute == "selective":
            model_cfg.recompute_modules = ["core_attn"] + (
                ["moe"] if model_cfg.num_moe_experts else []
            )
    dtype = torch.bfloat16 if run.trainer.precision == "bf16" else torch.float32
    # Per-adapter losses are normalised over the global batch: gradients are summed over
    # data-parallel ranks, not averaged (megatron's per-token-loss convention).
    chunks = build_model_chunks(
        model_cfg,
        sequence_parallel=run.parallel.sp,
        params_dtype=dtype,
        cpu_gemm_dtype=cpu_gemm_dtype(run.trainer.cpu_base_gemms),
        calculate_per_token_loss=True,
        **(INIT_FOR_CHECKPOINT if run.hf_dir else {}),
    )
    if run.hf_dir:  # each pipeline rank reads its own stage's layers
        load_hf_checkpoint(chunks, run.hf_dir, model_cfg)
    return apply_multi_lora(
        chunks,
        run.lora.slots,
        run.lora.max_rank,
        alpha=1.0,
        target_modules=run.lora.targets,
        column_init_method=run.lora.column_init_method,
        row_init_method=run.lora.row_init_method,
        seed=run.seed,
        fully_sharded=run.lora.fully_sharded,
    )

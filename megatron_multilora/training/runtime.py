"""What the trainer and the training service both run on, built once from a run's config.

:meth:`Runtime.build` sets up the parallel layout, the tokenizer, the model with its adapter
slots (``model_setup``), the one step of every slot (:class:`.step.slot_step.SlotStep`) and
the paged table of the adapters that wait for a slot (:class:`.step.adapter_table.AdapterTable`).
:meth:`Runtime.start_slot` puts an adapter into a slot (a job's ``init_from`` folder or
fresh weights drawn by its name) with its optimizer, :meth:`Runtime.free_slot` gives the slot
back; :meth:`Runtime.tools` is what objectives prepare with and samples come from. The
trainer's jobs (``jobs/``) and the service's clients (``api/``) are the fronts above it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from megatron.core import parallel_state

from megatron_multilora.checkpoint.adapter_files import import_adapter
from megatron_multilora.checkpoint.adapter_folders import FolderFormat, folder_format
from megatron_multilora.checkpoint.peft_format import import_peft
from megatron_multilora.data.tokenizer import ByteTokenizer, HFTokenizer
from megatron_multilora.layers.lifecycle import (
    TARGET_PARTS,
    clear_adapter_slot,
    init_adapter_slot,
    restrict_adapter_slot,
)
from megatron_multilora.models.gpt_config import GPTModelConfig
from megatron_multilora.models.hf_config import read_hf_config
from megatron_multilora.models.hf_import import load_hf_tokenizer
from megatron_multilora.parallel import init_parallel
from megatron_multilora.training.config import AdapterJob, RunConfig, base_model_config, job_alpha
from megatron_multilora.training.model_setup import build_run_model
from megatron_multilora.training.step.adapter_table import AdapterTable
from megatron_multilora.training.step.objective_tools import StepTools
from megatron_multilora.training.step.slot_optimizer import SlotOptimizer
from megatron_multilora.training.step.slot_step import SlotStep


@dataclasses.dataclass
class Runtime:
    run: RunConfig
    model_config: GPTModelConfig  # the base's architecture (hf_dir's, or run.model)
    hf_model_type: str | None  # the HF model type: PEFT module names, adapter metadata
    tokenizer: Any
    model: list[torch.nn.Module]  # the chunks (one per virtual pipeline stage)
    step: SlotStep
    table: AdapterTable = dataclasses.field(init=False)  # the adapters of more jobs than slots

    def __post_init__(self) -> None:
        self.table = AdapterTable(self.step)

    @classmethod
    def build(cls, run: RunConfig) -> Runtime:
        par = run.parallel
        init_parallel(
            tensor_model_parallel_size=par.tp,
            expert_model_parallel_size=par.ep,
            pipeline_model_parallel_size=par.pp,
            virtual_pipeline_model_parallel_size=par.vpp,
            sequence_parallel=par.sp,
            seed=run.seed,
        )
        model_config = base_model_config(run)
        hf_model_type = read_hf_config(run.hf_dir)["model_type"] if run.hf_dir else None
        tokenizer = HFTokenizer(load_hf_tokenizer(run.hf_dir)) if run.hf_dir else ByteTokenizer()
        model = build_run_model(run, model_config)
        pad_multiple = par.tp if par.sp else 1  # sequence parallelism splits positions
        tr = run.trainer
        step = SlotStep(
            model,
            run.lora.slots,
            tr.micro_batch_tokens,
            pad_multiple,
            tokenizer.pad_id,
            tr.cuda_graphs,
            tr.max_seq_len,
        )
        return cls(run, model_config, hf_model_type, tokenizer, model, step)

    @property
    def pad_multiple(self) -> int:
        return self.step.batcher.pad_multiple

    @property
    def dp_rank(self) -> int:
        return parallel_state.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return parallel_state.get_data_parallel_world_size()

    def start_slot(self, slot: int, job: AdapterJob, total_steps: int) -> SlotOptimizer:
        """Put ``job``'s adapter into ``slot`` (from its ``init_from`` folder, an adapter or a
        PEFT folder, or fresh weights); returns the slot's optimizer for ``total_steps``."""
        return start_job(self.model, slot, job, total_steps, self.model_config, self.hf_model_type)

    def free_slot(self, slot: int) -> None:
        """The slot back to a fresh one: its weights, rank, alpha and gradients."""
        self.step.drop([slot])
        clear_adapter_slot(self.model, slot)

    def tools(self, fail: Callable[[Any, str], None]) -> StepTools:
        """The reference passes and sampling of this model (``fail(job, reason)`` ends a job
        whose preparation failed)."""
        return StepTools(
            self.model,
            self.step.batcher,
            self.tokenizer,
            self.run.seed,
            self.run.trainer.max_seq_len,
            fail,
        )


def start_job(
    model: list[torch.nn.Module],
    slot: int,
    job: AdapterJob,
    total_steps: int,
    model_config: GPTModelConfig,
    hf_model_type: str | None = None,
) -> SlotOptimizer:
    """:meth:`Runtime.start_slot` on a model of its own (``hf_model_type`` names the PEFT
    modules, default llama)."""
    if job.init_from and folder_format(job.init_from) is FolderFormat.PEFT:
        import_peft(model, slot, job.init_from, model_config, hf_model_type or "llama")
    elif job.init_from:
        import_adapter(model, slot, job.init_from)
    else:  # initialised from the job, not the slot: the same adapter in any slot
        clear_adapter_slot(model, slot, init_key=job.name)
        parts = [p for p in TARGET_PARTS if getattr(job, f"train_{p}")]
        restrict_adapter_slot(model, slot, parts)
    # An imported adapter keeps its own alpha (the config check refused a differing job alpha).
    init_adapter_slot(model, slot, job.rank, job_alpha(job), job.dropout)
    return SlotOptimizer(model, slot, job, total_steps)

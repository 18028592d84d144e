"""Where a job's adapter goes when it ends: ``adapters/<name>/`` (the project's format) and,
on a Hugging Face base, ``peft/<name>/`` (PEFT, for peft and vLLM), with the meta that lets
either be rebuilt or exported again later (``mmlora export``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from megatron_multilora.checkpoint.adapter_files import export_adapter
from megatron_multilora.checkpoint.peft_format import export_peft
from megatron_multilora.layers.lifecycle import ModelOrChunks
from megatron_multilora.models.gpt_config import GPTModelConfig
from megatron_multilora.training.config import LoRASettings
from megatron_multilora.training.jobs.job import Job


class JobExporter:
    """Exports jobs' slots of ``model`` into ``run_dir`` (collective: every rank calls it)."""

    def __init__(
        self,
        run_dir: Path,
        model: ModelOrChunks,
        model_config: GPTModelConfig,
        lora: LoRASettings,
        hf_dir: str | None,
        hf_model_type: str | None,
    ) -> None:
        self.run_dir, self.model, self.model_config, self.lora = run_dir, model, model_config, lora
        self.hf_dir = str(Path(hf_dir).resolve()) if hf_dir else None
        self.hf_model_type = hf_model_type

    def folder(self, job: Job) -> Path:
        return self.run_dir / "adapters" / job.name

    def export(self, job: Job, cancelled: bool = False) -> None:
        """Write the job's slot as an adapter folder (and a PEFT folder on an HF base)."""
        meta = self.meta(job)
        if cancelled:
            meta["cancelled"] = True
        export_adapter(self.model, job.slot, self.folder(job), meta, overwrite=True)
        if self.hf_dir:
            export_peft(
                self.model,
                job.slot,
                self.run_dir / "peft" / job.name,
                self.model_config,
                self.hf_model_type,
                self.hf_dir,
                overwrite=True,
                dropout=job.spec.dropout,
            )

    def meta(self, job: Job) -> dict[str, Any]:
        """What an exported adapter (and a checkpoint, for its training jobs) records beside
        the tensors: enough to rebuild the base's shapes and name its modules."""
        meta = {
            "name": job.name,
            "dropout": job.spec.dropout,
            "targets": list(self.lora.targets),
            "max_rank": self.lora.max_rank,
            "steps": job.steps_done,
            "total_steps": job.total_steps,
            "finished": job.finished_budget,
            "base_model": dataclasses.asdict(self.model_config),
        }
        if self.hf_dir:
            meta.update(hf_dir=self.hf_dir, hf_model_type=self.hf_model_type)
        return meta

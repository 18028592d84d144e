"""Group relative policy optimisation (Shao et al. 2024) with the frozen base as reference.

Each step of a rollout trains on the job's sampled completions (``Rollout``): per token,
``ppo(logprobs, sampling logprobs, advantage, clip_low, clip_high)`` plus ``kl_coef`` times
the k3 KL to the base (the adapter off) times the importance ratio, weighted by ``weights``: 1 per completion token
(``token_mean``: the loss is the mean over the batch's completion tokens) or 1 / its length
(``sequence_mean``: each completion's token mean, then the mean over completions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_multilora.data.datasets import read_records, tokenize_record
from megatron_multilora.training.objectives.objective import JobData, Objective, RunTools
from megatron_multilora.training.objectives.rollouts import sample_rollouts
from megatron_multilora.training.objectives.sft import SFT
from megatron_multilora.training.objectives.token_losses import kl_to_reference, ppo


class GRPO(Objective):
    name = "grpo"
    metrics = ("kl", "clip_fraction")

    def __init__(self, clip_low: float, clip_high: float, kl_coef: float) -> None:
        self.clip_low, self.clip_high, self.kl_coef = clip_low, clip_high, kl_coef

    def load(self, spec: Any, tokenizer, max_seq_len: int, eval_samples: int) -> JobData:
        """The prompt records (completions are sampled); held-out records with an
        ``answer`` give the eval loss on it and are generated from."""
        train = read_records(spec.dataset, "prompt", spec.columns)
        if not spec.eval_dataset:
            return JobData(train, [], [])
        records = [
            {"prompt": r["prompt"], "completion": str(r["answer"])}
            for r in read_records(spec.eval_dataset, "prompt", spec.columns)
            if "answer" in r
        ][:eval_samples]
        held_out = [
            tokenize_record(r, tokenizer, max_seq_len)
            for r in records
            if isinstance(r["prompt"], str)
        ]
        return JobData(train, held_out, [r for r in records if isinstance(r["prompt"], str)])

    @classmethod
    def prepare(cls, jobs: Sequence[Any], tools: RunTools) -> None:
        """A new rollout for every job whose last one has had its ``inner_steps`` steps (or
        that has none yet), all sampled in one pass."""
        due = [
            job
            for job in jobs
            if job.rollout is None
            or job.rollout.index != job.steps_done // job.spec.grpo.inner_steps
        ]
        if due:
            sample_rollouts(
                due,
                tools.model,
                tools.batcher,
                tools.tokenizer,
                tools.seed,
                tools.max_seq_len,
                tools.fail,
            )

    def batch(self, job: Any, seed: int) -> list:
        return list(job.rollout.examples)

    def eval_objective(self) -> Objective:
        return SFT()  # held-out answers are scored as completions: their cross-entropy

    def span_loss(self, logprobs, mask, values, sequence):
        old, weights = values["logprobs"], values["weights"]
        loss = ppo(logprobs, old, values["advantages"], self.clip_low, self.clip_high)
        # The KL's samples come from the sampling policy: weighed by the importance ratio it
        # estimates the current policy's KL (TRL's use_bias_correction_kl, its default).
        kl = (
            kl_to_reference(logprobs, values["ref_logprobs"]) * torch.exp(logprobs - old)
            if self.kl_coef
            else torch.zeros_like(logprobs)
        )
        ratio = torch.exp(logprobs.detach() - old)
        clipped = ((ratio < 1 - self.clip_low) | (ratio > 1 + self.clip_high)).float()
        metrics = torch.stack([(kl.detach() * weights).sum(), (clipped * weights).sum()])
        return ((loss + self.kl_coef * kl) * weights).sum(), metrics

"""Group relative policy optimisation (Shao et al. 2024) with the frozen base as reference.

Each step of a rollout trains on the job's sampled completions (``Rollout``): per token,
the policy loss it names (``loss``, one of Tinker's: PPO's clipped surrogate by default) plus
``kl_coef`` times the k3 KL to the base (the adapter off) times the importance ratio,
weighted by ``weights``:
1 per completion token (``token_mean``: the loss is the mean over the batch's completion
tokens) or 1 / its length (``sequence_mean``: each completion's token mean, then the mean
over completions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from megatron_multilora.data.datasets import read_records, tokenize_record
from megatron_multilora.training.objectives.objective import JobData, Objective, RunTools
from megatron_multilora.training.objectives.rewards import (
    BUILT_IN,
    Reward,
    RewardError,
    load_reward,
)
from megatron_multilora.training.objectives.rollouts import Rollout, reward_stats, sample_rollouts
from megatron_multilora.training.objectives.sft import SFT
from megatron_multilora.training.objectives.token_losses import TOKEN_LOSSES, kl_to_reference
from megatron_multilora.validation import Rule, at_least, one_of, positive, ranged, within

POLICY_LOSSES = tuple(name for name in TOKEN_LOSSES if name != "cross_entropy")


@dataclasses.dataclass
class GRPOSettings:
    group_size: int = ranged(4, at_least(2))
    """Completions sampled per prompt; advantages are normalised within each group."""
    temperature: float = ranged(1.0, positive())
    top_p: float = ranged(1.0, Rule("in (0, 1]", lambda v: 0.0 < v <= 1.0))
    max_new_tokens: int = ranged(16, at_least(1))
    inner_steps: int = ranged(1, at_least(1))
    """Optimizer steps on each batch of samples before sampling the next."""
    loss: str = ranged("ppo", one_of(*POLICY_LOSSES))
    """The policy loss, by Tinker's name (``token_losses.TOKEN_LOSSES``)."""
    clip_low: float = ranged(0.2, within(0.0, 1.0))
    clip_high: float = ranged(0.2, at_least(0.0))
    """ppo, cispo and gspo clip the importance ratio to [1 - clip_low, 1 + clip_high];
    stable_reinforce caps it at 1 + clip_high."""
    dro_beta: float = ranged(0.05, at_least(0.0))
    """dro's weight of the squared log-ratio."""
    kl_coef: float = ranged(0.0, at_least(0.0))
    """Weight of the KL to the base model (the adapter off; 0: no reference pass)."""
    aggregation: str = ranged("token_mean", one_of("token_mean", "sequence_mean"))
    """token_mean: over every completion token of the batch; sequence_mean: each
    completion's token mean, then over completions."""
    scale_rewards: bool = True
    """Divide advantages by the group's reward std (false: Dr. GRPO)."""
    reward: str = "exact_match"
    """exact_match or word_match (against each record's "answer"), or module:function
    called with prompt=, completion=, record= and returning a number."""


@dataclasses.dataclass
class GRPOState:
    """A GRPO job between steps: its reward function and the rollout it trains on."""

    reward: Reward
    rollout: Rollout | None = None


class GRPO(Objective):
    name = "grpo"
    record_form = "prompt"
    settings = GRPOSettings
    metrics = ("kl", "clip_fraction")
    # The sampler's log-probs, advantages and token weights come with the samples (a
    # rollout); the base's log-probs with them where kl_coef > 0.
    inputs = ("logprobs", "advantages", "weights", "ref_logprobs")

    def __init__(
        self,
        clip_low: float,
        clip_high: float,
        kl_coef: float,
        loss: str = "ppo",
        dro_beta: float = 0.05,
    ) -> None:
        self.clip_low, self.clip_high, self.kl_coef = clip_low, clip_high, kl_coef
        self.loss = TOKEN_LOSSES[loss]
        config = {
            "clip_low_threshold": 1.0 - clip_low,
            "clip_high_threshold": 1.0 + clip_high,
            "beta": dro_beta,
        }
        # The job's settings where they set one of the loss's keys, else its defaults.
        self.config = {k: config.get(k, default) for k, default in self.loss.config.items()}

    @classmethod
    def build(cls, spec: Any) -> GRPO:
        g = spec.grpo
        return cls(g.clip_low, g.clip_high, g.kl_coef, g.loss, g.dro_beta)

    @classmethod
    def problems(cls, spec: Any, where: str, max_seq_len: int) -> list[str]:
        problems = []
        try:
            load_reward(spec.grpo.reward)
        except RewardError as err:
            problems.append(f"{where}grpo.{err}")
        if spec.grpo.max_new_tokens >= max_seq_len:
            problems.append(
                f"{where}grpo.max_new_tokens={spec.grpo.max_new_tokens}: must be "
                f"below trainer.max_seq_len={max_seq_len} (the prompt needs room)"
            )
        return problems

    @classmethod
    def record_problems(cls, spec: Any, field: str, records: list[dict], where: str) -> list[str]:
        if spec.grpo.reward not in BUILT_IN or field != "dataset":
            return []
        missing = next((i for i, r in enumerate(records) if "answer" not in r), None)
        if missing is None:
            return []
        return [
            f'{where}{field}: {spec.dataset}: record {missing} has no "answer", '
            f"which grpo.reward={spec.grpo.reward} compares the completion "
            "with (map a column to it with columns: {answer: <column>})"
        ]

    @classmethod
    def steps_per_batch(cls, spec: Any) -> int:
        return spec.grpo.inner_steps

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

    def new_state(self, spec: Any) -> GRPOState:
        return GRPOState(load_reward(spec.grpo.reward))

    def state_to_plain(self, state: GRPOState) -> dict[str, Any]:
        return {"rollout": state.rollout.to_plain() if state.rollout else None}

    def state_from_plain(self, state: GRPOState, plain: dict[str, Any]) -> GRPOState:
        saved = plain.get("rollout")
        return dataclasses.replace(state, rollout=Rollout.from_plain(saved) if saved else None)

    @classmethod
    def prepare(cls, jobs: Sequence[Any], tools: RunTools) -> None:
        """A new rollout for every job whose last one has had its ``inner_steps`` steps (or
        that has none yet), all sampled in one pass."""
        due = [
            job
            for job in jobs
            if job.state.rollout is None
            or job.state.rollout.index != job.steps_done // job.spec.grpo.inner_steps
        ]
        if due:
            sample_rollouts(due, tools)

    def batch(self, job: Any, seed: int) -> list:
        return list(job.state.rollout.examples)

    def step_metrics(self, state: GRPOState) -> dict[str, float]:
        return reward_stats(state.rollout) if state.rollout else {}

    def eval_objective(self) -> Objective:
        return SFT()  # held-out answers are scored as completions: their cross-entropy

    def span_loss(self, logprobs, mask, values, sequence):
        import torch

        old, weights = values["logprobs"], values["weights"]
        inputs = {**values, "sequence_ratio_mask": weights}  # gspo's: the completion tokens
        loss = self.loss.per_token(logprobs, inputs, self.config, sequence)
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

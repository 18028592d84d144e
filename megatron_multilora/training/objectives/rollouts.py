"""GRPO rollouts: every GRPO job's prompts x group size sampled in one generation pass, each
row through its job's adapter, scored, and turned into the examples its next
``inner_steps`` steps train on.

A row's draws are keyed by ``seed:job:rollout:row`` (``step/sampling.py``), so a job's samples
and so its trajectory do not depend on the other jobs, and a resumed run samples the same.
Advantages are group-normalised: ``(r - mean) / (std + 1e-4)`` within each prompt's group
(``scale_rewards=false``: ``r - mean``, Dr. GRPO).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_multilora.data.datasets import Example
from megatron_multilora.data.record_forms import prompt_ids
from megatron_multilora.training.objectives.rewards import RewardError, score
from megatron_multilora.training.step import generation
from megatron_multilora.training.step.micro_batches import MicroBatcher
from megatron_multilora.training.step.reference import target_logprobs
from megatron_multilora.training.step.sampling import KeyedSampler, RowSampling


@dataclasses.dataclass
class Rollout:
    """One batch of a GRPO job's samples: which rollout of the job it is, its examples (the
    prompt x group rows, in order) and each row's reward."""

    index: int
    examples: list[Example]
    rewards: list[float]

    def to_plain(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "rewards": self.rewards,
            "examples": [
                {
                    "tokens": list(e.tokens),
                    "loss_mask": list(e.loss_mask),
                    "values": {k: list(v) for k, v in e.values.items()},
                    "units": e.units,
                }
                for e in self.examples
            ],
        }

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> Rollout:
        return cls(
            plain["index"],
            [
                Example(
                    tuple(e["tokens"]),
                    tuple(e["loss_mask"]),
                    {k: tuple(v) for k, v in e["values"].items()},
                    e["units"],
                )
                for e in plain["examples"]
            ],
            plain["rewards"],
        )


@dataclasses.dataclass
class Row:
    """One sampled row before scoring: its job, prompt record and tokens."""

    job: Any
    index: int  # of the record in the job's data
    record: dict
    prompt: list[int]


def advantages(rewards: Sequence[float], group_size: int, scale: bool) -> list[float]:
    out = []
    for start in range(0, len(rewards), group_size):
        group = torch.tensor(rewards[start : start + group_size], dtype=torch.float64)
        centred = group - group.mean()
        out += (centred / (group.std() + 1e-4) if scale else centred).tolist()
    return out


def sample_rollouts(
    jobs: Sequence[Any],
    model,
    batcher: MicroBatcher,
    tokenizer,
    seed: int,
    max_seq_len: int,
    fail: Callable[[Any, str], None],
) -> None:
    """Give each of ``jobs`` (GRPO jobs due for a rollout) its next :class:`Rollout`, all
    sampled in one pass; a job whose reward fails is handed to ``fail(job, reason)`` and
    the others go on."""
    rows, sampling, limits = [], [], []
    for job in jobs:
        g = job.spec.grpo
        index = job.steps_done // g.inner_steps
        budget = max_seq_len - g.max_new_tokens
        for p, sample in enumerate(job.next_samples(job.spec.global_batch_size, seed)):
            record = job.train[sample]
            ids = prompt_ids(record["prompt"], tokenizer)
            ids = ids[:1] + ids[1:][-(budget - 1) :] if len(ids) > budget else ids  # keep bos
            for k in range(g.group_size):
                rows.append(Row(job, sample, record, ids))
                sampling.append(
                    RowSampling(
                        f"{seed}:{job.name}:{index}:{p * g.group_size + k}", g.temperature, g.top_p
                    )
                )
                limits.append(g.max_new_tokens)
    outputs = generation.generate(
        model,
        [(row.job.slot, row.prompt) for row in rows],
        batcher.n_slots,
        limits,
        tokenizer.eos_id,
        batcher.pad_multiple,
        tokenizer.pad_id,
        pick=KeyedSampler(sampling),
    )
    by_job: dict[str, list[tuple[Row, generation.Generation]]] = {}
    for row, out in zip(rows, outputs):
        by_job.setdefault(row.job.name, []).append((row, out))
    made = {}
    for job in jobs:
        try:
            made[job.name] = _examples(job, by_job[job.name], tokenizer)
        except RewardError as e:
            fail(job, str(e))
    _add_references(made, jobs, model, batcher)
    for job in jobs:
        if job.name in made:
            examples, rewards = made[job.name]
            job.rollout = Rollout(job.steps_done // job.spec.grpo.inner_steps, examples, rewards)


def _examples(
    job, rows: list[tuple[Row, generation.Generation]], tokenizer
) -> tuple[list[Example], list[float]]:
    g = job.spec.grpo
    rewards = []
    for _i, (row, out) in enumerate(rows):
        try:
            rewards.append(
                score(
                    job.reward,
                    g.reward,
                    row.record["prompt"],
                    tokenizer.decode(out.tokens),
                    row.record,
                )
            )
        except RewardError as e:
            raise RewardError(
                f"job {job.name}, {job.spec.dataset} record {row.index}: {e}"
            ) from None
    adv = advantages(rewards, g.group_size, g.scale_rewards)
    examples = []
    for (row, out), a in zip(rows, adv):
        n = len(out.logprobs)  # generated tokens, eos included when it ended
        head = len(row.prompt) - 1
        completion = out.tokens + ([out.stop] if out.ended else [])
        weight = 1.0 if g.aggregation == "token_mean" else 1.0 / n
        examples.append(
            Example(
                tuple(row.prompt + completion),
                (False,) * head + (True,) * n,
                {
                    "logprobs": (0.0,) * head + tuple(out.logprobs),
                    "advantages": (0.0,) * head + (a,) * n,
                    "weights": (0.0,) * head + (weight,) * n,
                },
                units=None if g.aggregation == "token_mean" else 1,
            )
        )
    return examples, rewards


def _add_references(made: dict, jobs: Sequence[Any], model, batcher: MicroBatcher) -> None:
    """The base's log-probs of every row of the jobs with a KL term, in one pass."""
    kl_jobs = [job for job in jobs if job.name in made and job.spec.grpo.kl_coef]
    slot_examples: list[list[Example]] = [[] for _ in range(batcher.n_slots)]
    for job in kl_jobs:
        slot_examples[job.slot] = made[job.name][0]
    if not kl_jobs:
        return
    refs = target_logprobs(model, slot_examples, batcher)
    for job in kl_jobs:
        examples, rewards = made[job.name]
        made[job.name] = (
            [
                dataclasses.replace(e, values={**e.values, "ref_logprobs": tuple(r)})
                for e, r in zip(examples, refs[job.slot])
            ],
            rewards,
        )


def reward_stats(rollout: Rollout) -> dict[str, float]:
    rewards = rollout.rewards
    return {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
    }

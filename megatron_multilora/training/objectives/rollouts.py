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
from collections.abc import Sequence
from typing import Any

from megatron_multilora.data.datasets import Example
from megatron_multilora.data.record_forms import prompt_ids
from megatron_multilora.training.objectives.objective import RunTools, SampleRequest
from megatron_multilora.training.objectives.rewards import RewardError, score


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
    import torch  # see objective.py: imported where it computes

    out = []
    for start in range(0, len(rewards), group_size):
        group = torch.tensor(rewards[start : start + group_size], dtype=torch.float64)
        centred = group - group.mean()
        out += (centred / (group.std() + 1e-4) if scale else centred).tolist()
    return out


def sample_rollouts(jobs: Sequence[Any], tools: RunTools) -> None:
    """Give each of ``jobs`` (GRPO jobs due for a rollout) its next :class:`Rollout`, all
    sampled in one pass; a job whose reward fails is handed to ``tools.fail(job, reason)``
    and the others go on."""
    rows, requests = [], []
    for job in jobs:
        g = job.spec.grpo
        index = job.steps_done // g.inner_steps
        budget = tools.max_seq_len - g.max_new_tokens
        for p, sample in enumerate(job.next_samples(job.spec.global_batch_size, tools.seed)):
            record = job.train[sample]
            ids = prompt_ids(record["prompt"], tools.tokenizer)
            ids = ids[:1] + ids[1:][-(budget - 1) :] if len(ids) > budget else ids  # keep bos
            for k in range(g.group_size):
                rows.append(Row(job, sample, record, ids))
                key = f"{tools.seed}:{job.name}:{index}:{p * g.group_size + k}"
                requests.append(
                    SampleRequest(job.slot, ids, key, g.temperature, g.top_p, g.max_new_tokens)
                )
    by_job: dict[str, list[tuple[Row, Any]]] = {}
    for row, out in zip(rows, tools.generate(requests)):
        by_job.setdefault(row.job.name, []).append((row, out))
    made = {}
    for job in jobs:
        try:
            made[job.name] = _examples(job, by_job[job.name], tools.tokenizer)
        except RewardError as e:
            tools.fail(job, str(e))
    _add_references(made, jobs, tools)
    for job in jobs:
        if job.name in made:
            examples, rewards = made[job.name]
            index = job.steps_done // job.spec.grpo.inner_steps
            job.state.rollout = Rollout(index, examples, rewards)


def _examples(job, rows: list[tuple[Row, Any]], tokenizer) -> tuple[list[Example], list[float]]:
    g = job.spec.grpo
    rewards = []
    for row, out in rows:
        try:
            completion = tokenizer.decode(out.tokens)
            rewards.append(
                score(job.state.reward, g.reward, row.record["prompt"], completion, row.record)
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


def _add_references(made: dict, jobs: Sequence[Any], tools: RunTools) -> None:
    """The base's log-probs of every row of the jobs with a KL term, in one pass."""
    kl_jobs = [job for job in jobs if job.name in made and job.spec.grpo.kl_coef]
    if not kl_jobs:
        return
    refs = tools.reference_logprobs({job.slot: made[job.name][0] for job in kl_jobs})
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

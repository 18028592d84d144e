"""What every objective answers, behind one interface: how its job's data loads, what it
needs before a step, the records of a step's global batch, and its loss on one adapter's
span of a packed micro-batch.

The step's loss function (``step/schedule.objective_loss``) cuts each micro-batch into the
slots' spans and hands each span to its job's objective with the trained log-probs of the
span's targets, its loss mask, the per-token inputs its examples carry (``Example.values``)
and which packed sequence each position belongs to. The objective returns the span's loss
*sum* and the sums of its metrics; the step divides both by the adapter's loss units over
its global batch, so an adapter's loss and metrics never depend on who shares the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from megatron_multilora.data.datasets import Packable, load_dataset, read_records

# The widest metrics row any objective reports (the step's per-slot table has 1 + this).
MAX_METRICS = 4


@dataclasses.dataclass
class RunTools:
    """What an objective's preparation may use: the model (its chunks), a micro-batcher for
    its slots, the tokenizer, the run's seed and sequence limit, and ``fail(job, reason)``
    to stop one job (the others go on)."""

    model: Any
    batcher: Any
    tokenizer: Any
    seed: int
    max_seq_len: int
    fail: Callable[[Any, str], None]


@dataclasses.dataclass
class JobData:
    """A job's data as its objective loads it: what it trains on, its held-out examples
    (their loss is the job's eval loss) and held-out records with a ``prompt`` and an
    expected ``completion`` (the exact-match accuracy of greedy generations)."""

    train: list
    eval: list
    eval_records: list[dict]


class Objective:
    """One job's objective (its settings held by the instance). The defaults are SFT's."""

    name: ClassVar[str]
    metrics: ClassVar[tuple[str, ...]] = ()  # reported per step, means over loss units
    table_metrics: ClassVar[
        tuple[str, ...]
    ] = ()  # of metrics, a table each in a run's final report

    def load(self, spec: Any, tokenizer, max_seq_len: int, eval_samples: int) -> JobData:
        train = load_dataset(spec.dataset, tokenizer, max_seq_len, spec.columns)
        if not spec.eval_dataset:
            return JobData(train, [], [])
        records = read_records(spec.eval_dataset, "completion", spec.columns)[:eval_samples]
        held_out = load_dataset(spec.eval_dataset, tokenizer, max_seq_len, spec.columns)
        return JobData(train, held_out[:eval_samples], records)

    @classmethod
    def prepare(cls, jobs: Sequence[Any], tools: RunTools) -> None:
        """Before a step: whatever these jobs (all of this objective's training jobs) need,
        done for all of them at once."""

    def batch(self, job: Any, seed: int) -> list[Packable]:
        """The job's global batch for this step."""
        return [job.train[i] for i in job.next_samples(job.spec.global_batch_size, seed)]

    def eval_objective(self) -> Objective:
        """What the job's held-out examples are scored with (its eval loss)."""
        return self

    def span_loss(
        self,
        logprobs: torch.Tensor,
        mask: torch.Tensor,
        values: dict[str, torch.Tensor],
        sequence: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss sum, metric sums [len(metrics)])`` over one adapter's positions.

        ``logprobs`` ``[T]`` (0 where ``mask`` is 0), ``mask`` ``[T]`` float, ``values`` the
        per-token inputs ``[T]`` each, ``sequence`` ``[T]`` int64 the packed sequence of each
        position, numbered from 0 within the span."""
        raise NotImplementedError

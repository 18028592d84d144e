"""What every objective answers, behind one interface: what its jobs' config and data are,
what its rows need before a step, the records of a step's global batch, and its loss on one
adapter's span of a packed micro-batch. The step, the job, the config and its checks know
objectives through this interface only; :mod:`.registry` lists them.

An objective declares:

* ``name``, ``record_form`` (the form its records come in: ``data/record_forms.py``) and
  ``settings`` (the dataclass of its config section, a job's field named after it);
* ``metrics`` (reported per step) and ``table_metrics`` (a table each in a run's report);
* ``inputs``: the per-token values its loss reads (``Example.values``): the data carries
  them, or :meth:`Objective.prepare` computes them before a step through :class:`RunTools`:
  the base's log-probs of its rows (:meth:`RunTools.reference_logprobs`, the adapters off)
  or samples of its adapter (:meth:`RunTools.generate`); what a job keeps between steps is
  its ``state`` (:meth:`Objective.new_state`), saved in checkpoints.

The step's loss function (``step/schedule.objective_loss``) cuts each micro-batch into the
slots' spans and hands the spans of each objective, all at once, to it
(:meth:`Objective.spans_loss`; by default each to :meth:`Objective.span_loss`) with the
trained log-probs of the span's targets, its loss mask, the per-token inputs its examples
carry and which packed sequence each position belongs to. The objective returns the span's loss *sum* and the sums
of its metrics; the step divides both by the adapter's loss units over its global batch, so
an adapter's loss and metrics never depend on who shares the step.

Objective modules import torch only where they compute (torch's functions inside a loss,
tensors' own methods elsewhere): the config check reads their declarations without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from megatron_multilora.data.datasets import Packable, load_dataset, read_records

if TYPE_CHECKING:
    import torch

# The widest metrics row any objective reports (the step's per-slot table has 1 + this).
MAX_METRICS = 4


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """One row to sample from an adapter: its slot, its prompt's token ids, the key its
    draws are drawn by (``step/sampling.py``: the same key, the same tokens), its
    temperature and top-p, the most tokens it may generate, and the tokens that end it
    besides the end-of-sequence token."""

    slot: int
    prompt: list[int]
    key: str
    temperature: float
    top_p: float
    max_new_tokens: int
    stop_tokens: frozenset[int] = frozenset()


class RunTools(Protocol):
    """What an objective's preparation may use (the step's side implements it)."""

    tokenizer: Any
    seed: int
    max_seq_len: int

    def fail(self, job: Any, reason: str) -> None:
        """Stop one job (the others go on)."""

    def reference_logprobs(self, by_slot: dict[int, Sequence[Packable]]) -> dict[int, list]:
        """For each slot's items, per example (groups flattened, in order), the base's
        log-prob of each of its targets (the adapters off), all in one forward-only pass."""

    def generate(self, requests: Sequence[SampleRequest]) -> list:
        """Each request's completion, all in one generation pass: ``tokens``, the
        ``logprobs`` of the generated tokens, ``stop`` (the stop token, where ``ended``)."""


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
    record_form: ClassVar[str] = "completion"
    settings: ClassVar[type | None] = None
    metrics: ClassVar[tuple[str, ...]] = ()  # reported per step, means over loss units
    table_metrics: ClassVar[tuple[str, ...]] = ()  # of metrics, a table each in the report
    inputs: ClassVar[tuple[str, ...]] = ()

    # ----- the config -----------------------------------------------------------------------

    @classmethod
    def build(cls, spec: Any) -> Objective:
        """The objective of a job's config entry (an ``AdapterJob``), from its section."""
        return cls()

    @classmethod
    def problems(cls, spec: Any, where: str, max_seq_len: int) -> list[str]:
        """What is wrong with a job's settings beyond each field's range (``where``
        prefixes each problem)."""
        return []

    @classmethod
    def record_problems(cls, spec: Any, field: str, records: list[dict], where: str) -> list[str]:
        """What is wrong with the records of a job's ``field`` (``dataset``,
        ``eval_dataset``) beyond their form."""
        return []

    @classmethod
    def steps_per_batch(cls, spec: Any) -> int:
        """Optimizer steps on each global batch of records (an epoch's step count)."""
        return 1

    # ----- a job ----------------------------------------------------------------------------

    def load(self, spec: Any, tokenizer, max_seq_len: int, eval_samples: int) -> JobData:
        train = load_dataset(spec.dataset, tokenizer, max_seq_len, spec.columns)
        if not spec.eval_dataset:
            return JobData(train, [], [])
        records = read_records(spec.eval_dataset, "completion", spec.columns)[:eval_samples]
        held_out = load_dataset(spec.eval_dataset, tokenizer, max_seq_len, spec.columns)
        return JobData(train, held_out[:eval_samples], records)

    def new_state(self, spec: Any) -> Any:
        """What a job keeps between steps (None: nothing)."""
        return None

    def state_to_plain(self, state: Any) -> dict[str, Any]:
        """The state's part of a checkpoint (JSON-like; empty: nothing to save)."""
        return {}

    def state_from_plain(self, state: Any, plain: dict[str, Any]) -> Any:
        """The state a checkpoint's ``plain`` (a job's saved progress) restores."""
        return state

    @classmethod
    def prepare(cls, jobs: Sequence[Any], tools: RunTools) -> None:
        """Before a step: whatever these jobs (all of this objective's training jobs) need,
        done for all of them at once."""

    def batch(self, job: Any, seed: int) -> list[Packable]:
        """The job's global batch for this step."""
        return [job.train[i] for i in job.next_samples(job.spec.global_batch_size, seed)]

    def step_metrics(self, state: Any) -> dict[str, float]:
        """Metrics of a step that come from the job's state rather than its loss."""
        return {}

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

    @classmethod
    def spans_loss(
        cls,
        objectives: Sequence[Objective],
        logprobs: torch.Tensor,
        mask: torch.Tensor,
        values: dict[str, torch.Tensor],
        sequence: torch.Tensor,
        spans: Sequence[tuple[int, int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss sums [G], metric sums [G, len(metrics)])`` of several slots' spans of one
        micro-batch (slot g's objective ``objectives[g]``, its positions ``spans[g]``, a
        ``(start, end)`` each, in order), each what :meth:`span_loss` gives for it. The
        arguments cover the whole micro-batch. By default :meth:`span_loss` per span; an
        objective whose loss is a sum over positions computes every span in one pass."""
        import torch

        out = [
            objective.span_loss(
                logprobs[a:b],
                mask[a:b],
                {k: v[a:b] for k, v in values.items()},
                sequence[a:b] - sequence[a],
            )
            for objective, (a, b) in zip(objectives, spans)
        ]
        return torch.stack([loss for loss, _ in out]), torch.stack([m for _, m in out])

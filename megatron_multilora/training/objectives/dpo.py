"""Direct preference optimisation (Rafailov et al. 2023) against the frozen base.

A record is a (chosen, rejected) pair packed as two adjacent sequences of one micro-batch;
the chosen one's tokens carry ``chosen = 1``, both carry ``ref_logprobs``, the base's own
log-probs of their targets (the adapter off), computed once when the job starts. With
``h = (logp_c - ref_c) - (logp_r - ref_r)`` over the answers' tokens:

* ``sigmoid``: ``-(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)`` (``e`` the label
  smoothing);
* ``ipo``: ``(h - 1 / (2 beta))^2`` on length-averaged log-probs.

A pair is one loss unit: the loss is the mean over the global batch's pairs, as are the
rewards ``beta (logp - ref)`` of each answer, their margin and the preference accuracy.

``rpo_alpha`` > 0 adds that weight times the negative log-likelihood of the chosen answers,
its mean over every chosen token of the job's global batch (RPO, Pang et al. 2024; TRL's
``loss_type=["sigmoid", "sft"], loss_weights=[1, rpo_alpha]``): it keeps DPO from lowering
the chosen answers' own likelihood along with the rejected ones' (likelihood displacement,
which left the demo's DPO job worse at the behaviour it prefers). Each chosen token carries
``nll_scale = rpo_alpha * pairs / chosen tokens`` of its global batch, so that divided by the
pairs, as every span is, the term is the token mean. The held-out loss stays the DPO loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from megatron_multilora.data.datasets import Example, load_pairs, read_records
from megatron_multilora.training.objectives.objective import JobData, Objective, RunTools
from megatron_multilora.validation import at_least, one_of, positive, ranged, within


@dataclasses.dataclass
class DPOSettings:
    beta: float = ranged(0.1, positive())
    """Strength of the pull towards the reference (the base with the adapter off)."""
    loss_type: str = ranged("sigmoid", one_of("sigmoid", "ipo"))
    """sigmoid (Rafailov et al.) or ipo (squared, on length-averaged log-probs)."""
    label_smoothing: float = ranged(0.0, within(0.0, 0.5))
    """Assumed probability that a pair's preference is flipped (sigmoid loss only)."""
    rpo_alpha: float = ranged(0.0, at_least(0.0))
    """Weight of the chosen answers' mean negative log-likelihood added to the loss (RPO;
    TRL's loss_type [sigmoid, sft] with loss_weights [1, rpo_alpha]); 0: plain DPO."""


class DPO(Objective):
    name = "dpo"
    record_form = "preference"
    settings = DPOSettings
    metrics = ("chosen_reward", "rejected_reward", "margin", "preference_accuracy")
    table_metrics = ("preference_accuracy",)
    # the base's log-probs, computed when the job starts; the chosen tokens' NLL weight
    inputs = ("ref_logprobs", "chosen", "nll_scale")
    rpo_alpha = 0.0  # what a subclass without the NLL term (SimPO) draws its batches with

    def __init__(
        self, beta: float, loss_type: str, label_smoothing: float, rpo_alpha: float = 0.0
    ) -> None:
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing
        self.rpo_alpha = rpo_alpha

    @classmethod
    def build(cls, spec: Any) -> DPO:
        dpo = spec.dpo
        return cls(dpo.beta, dpo.loss_type, dpo.label_smoothing, dpo.rpo_alpha)

    def batch(self, job: Any, seed: int) -> list:
        return with_nll_scale(super().batch(job, seed), self.rpo_alpha)

    def load(self, spec: Any, tokenizer, max_seq_len: int, eval_samples: int) -> JobData:
        """Train and held-out pairs (the eval loss is the DPO loss on held-out pairs); string
        pairs are also generated from, their chosen answer the expected one."""
        train = load_pairs(spec.dataset, tokenizer, max_seq_len, spec.columns)
        if not spec.eval_dataset:
            return JobData(train, [], [])
        held_out = load_pairs(spec.eval_dataset, tokenizer, max_seq_len, spec.columns)
        records = read_records(spec.eval_dataset, "preference", spec.columns)[:eval_samples]
        return JobData(
            train,
            held_out[:eval_samples],
            [
                {"prompt": r["prompt"], "completion": r["chosen"]}
                for r in records
                if isinstance(r["prompt"], str) and isinstance(r["chosen"], str)
            ],
        )

    def new_state(self, spec: Any) -> bool:
        return False  # whether the job's pairs carry their reference log-probs

    @classmethod
    def prepare(cls, jobs: Sequence[Any], tools: RunTools) -> None:
        """The base's log-probs of every pair of the jobs not yet prepared (when they start
        or resume), computed once, forward only, with the adapters off."""
        for job in (job for job in jobs if not job.state):
            job.train, job.eval = (
                with_references(pairs, job.slot, tools) for pairs in (job.train, job.eval)
            )
            job.state = True

    def span_loss(self, logprobs, mask, values, sequence):
        import torch
        import torch.nn.functional as F

        n = int(sequence[-1]) + 1
        per_seq = logprobs.new_zeros(n).index_add(
            0, sequence, (logprobs - values["ref_logprobs"]) * mask
        )
        chosen = mask.new_zeros(n).index_add(0, sequence, values["chosen"] * mask) > 0
        first = chosen.nonzero().flatten()  # each pair's chosen sequence; its rejected one follows
        c, r = per_seq[first], per_seq[first + 1]
        if self.loss_type == "ipo":
            lengths = mask.new_zeros(n).index_add(0, sequence, mask)
            c, r = c / lengths[first], r / lengths[first + 1]
        h = c - r
        if self.loss_type == "ipo":
            loss = (h - 1.0 / (2.0 * self.beta)) ** 2
        else:
            e = self.label_smoothing
            loss = -(1.0 - e) * F.logsigmoid(self.beta * h) - e * F.logsigmoid(-self.beta * h)
        cr, rr = self.beta * c.detach(), self.beta * r.detach()
        metrics = torch.stack([cr.sum(), rr.sum(), (cr - rr).sum(), (cr > rr).float().sum()])
        scale = values.get("nll_scale")
        if scale is not None:  # RPO: the chosen answers' NLL, weighed per token
            return loss.sum() - (logprobs * mask * scale).sum(), metrics
        return loss.sum(), metrics


def with_nll_scale(
    pairs: list[tuple[Example, Example]], rpo_alpha: float
) -> list[tuple[Example, Example]]:
    """A global batch of pairs with each chosen token's ``nll_scale``: ``rpo_alpha`` x the
    pairs / the chosen tokens of the batch (the module docstring); unchanged at 0."""
    if not rpo_alpha or not pairs:
        return pairs
    tokens = sum(sum(chosen.loss_mask) for chosen, _ in pairs)
    scale = rpo_alpha * len(pairs) / max(tokens, 1)
    return [
        (
            dataclasses.replace(
                chosen, values={**chosen.values, "nll_scale": (scale,) * len(chosen.loss_mask)}
            ),
            rejected,
        )
        for chosen, rejected in pairs
    ]


def with_references(
    pairs: list[tuple[Example, Example]], slot: int, tools: RunTools
) -> list[tuple[Example, Example]]:
    """``pairs`` with each token's reference log-prob (``ref_logprobs``) and the chosen
    answers marked (``chosen``)."""
    if not pairs:
        return pairs
    refs = iter(tools.reference_logprobs({slot: pairs})[slot])
    out = []
    for chosen, rejected in pairs:
        ones = (1.0,) * len(chosen.loss_mask)
        out.append(
            (
                dataclasses.replace(
                    chosen, values={"ref_logprobs": tuple(next(refs)), "chosen": ones}
                ),
                dataclasses.replace(rejected, values={"ref_logprobs": tuple(next(refs))}),
            )
        )
    return out

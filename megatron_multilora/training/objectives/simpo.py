"""SimPO (Meng et al. 2024): preference optimisation without a reference model.

A record is a (chosen, rejected) pair, as DPO's, packed as two adjacent sequences of one
micro-batch. With ``c`` and ``r`` the adapter's mean log-prob over each answer's tokens:
``loss = -(1 - e) log sigmoid(beta (c - r) - gamma) - e log sigmoid(-(beta (c - r) - gamma))``
(``gamma`` the target reward margin, ``e`` the label smoothing; TRL's ``CPOTrainer`` with
``loss_type="simpo"``). No reference pass: nothing to prepare before a step. A pair is one
loss unit; the rewards ``beta * c`` and ``beta * r``, their margin and the preference
accuracy are means over the global batch's pairs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_multilora.data.datasets import Example
from megatron_multilora.training.objectives.dpo import DPO
from megatron_multilora.training.objectives.objective import JobData
from megatron_multilora.validation import at_least, positive, ranged, within


@dataclasses.dataclass
class SimPOSettings:
    beta: float = ranged(2.0, positive())
    """Scale of the length-normalised log-prob difference."""
    gamma: float = ranged(1.0, at_least(0.0))
    """Target reward margin between the chosen and the rejected answer."""
    label_smoothing: float = ranged(0.0, within(0.0, 0.5))
    """Assumed probability that a pair's preference is flipped."""


class SimPO(DPO):
    """DPO's data, metrics and pairs; its own loss, on length-averaged log-probs alone."""

    name = "simpo"
    settings = SimPOSettings
    inputs = ("chosen",)

    def __init__(self, beta: float, gamma: float, label_smoothing: float) -> None:
        self.beta, self.gamma, self.label_smoothing = beta, gamma, label_smoothing

    @classmethod
    def build(cls, spec: Any) -> SimPO:
        return cls(spec.simpo.beta, spec.simpo.gamma, spec.simpo.label_smoothing)

    def load(self, spec: Any, tokenizer, max_seq_len: int, eval_samples: int) -> JobData:
        data = super().load(spec, tokenizer, max_seq_len, eval_samples)
        return JobData(marked(data.train), marked(data.eval), data.eval_records)

    def new_state(self, spec: Any) -> None:
        return None

    @classmethod
    def prepare(cls, jobs, tools) -> None:
        """Nothing: no reference log-probs."""

    def span_loss(self, logprobs, mask, values, sequence):
        import torch
        import torch.nn.functional as F

        n = int(sequence[-1]) + 1
        sums = logprobs.new_zeros(n).index_add(0, sequence, logprobs * mask)
        lengths = mask.new_zeros(n).index_add(0, sequence, mask)
        chosen = mask.new_zeros(n).index_add(0, sequence, values["chosen"] * mask) > 0
        first = chosen.nonzero().flatten()  # each pair's chosen sequence; its rejected one follows
        c, r = sums[first] / lengths[first], sums[first + 1] / lengths[first + 1]
        logits = (c - r) - self.gamma / self.beta
        e = self.label_smoothing
        loss = -F.logsigmoid(self.beta * logits) * (1 - e) - F.logsigmoid(-self.beta * logits) * e
        cr, rr = self.beta * c.detach(), self.beta * r.detach()
        metrics = torch.stack([cr.sum(), rr.sum(), (cr - rr).sum(), (cr > rr).float().sum()])
        return loss.sum(), metrics


def marked(pairs: list[tuple[Example, Example]]) -> list[tuple[Example, Example]]:
    """``pairs`` with their chosen answers' tokens marked (``chosen``)."""
    return [
        (dataclasses.replace(c, values={"chosen": (1.0,) * len(c.loss_mask)}), r) for c, r in pairs
    ]

"""A job's objective by name (``adapters[i].objective``), each a small class behind one
interface (:class:`.objective.Objective`); adding one is a module in this package and a line
below (its settings: a section of ``AdapterJob``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_multilora.training.objectives.dpo import DPO
from megatron_multilora.training.objectives.grpo import GRPO
from megatron_multilora.training.objectives.objective import Objective
from megatron_multilora.training.objectives.sft import SFT

BUILDERS: dict[str, Callable[[Any], Objective]] = {
    "sft": lambda spec: SFT(),
    "dpo": lambda spec: DPO(spec.dpo.beta, spec.dpo.loss_type, spec.dpo.label_smoothing),
    "grpo": lambda spec: GRPO(spec.grpo.clip_low, spec.grpo.clip_high, spec.grpo.kl_coef),
}


def objective_of(spec: Any) -> Objective:
    """The objective a job's config entry (an ``AdapterJob``) names, with its settings."""
    return BUILDERS[spec.objective](spec)

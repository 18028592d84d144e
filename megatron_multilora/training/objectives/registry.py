"""Every objective by name, each one module behind one interface
(:class:`.objective.Objective`): adding one is its module and a line here. A job names its
objective (``adapters[i].objective``) and sets its section (``adapters[i].<name>``, the
objective's ``settings``); a service client names a per-token loss (Tinker's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_multilora.training.objectives.dpo import DPO
from megatron_multilora.training.objectives.grpo import GRPO
from megatron_multilora.training.objectives.objective import Objective
from megatron_multilora.training.objectives.per_token import PerTokenLoss
from megatron_multilora.training.objectives.sft import SFT
from megatron_multilora.training.objectives.simpo import SimPO
from megatron_multilora.training.objectives.token_losses import TOKEN_LOSSES, TokenLoss

JOB_OBJECTIVES: dict[str, type[Objective]] = {cls.name: cls for cls in (SFT, DPO, GRPO, SimPO)}
"""What a job's ``objective`` may name."""

DEFAULT: type[Objective] = SFT
"""A job's objective when it names none, and what a slot given none is scored with."""

CLIENT_LOSSES: dict[str, TokenLoss] = TOKEN_LOSSES
"""The per-token losses a service client may name: the inputs each reads per position and
its ``loss_fn_config`` keys."""


def objective_of(spec: Any) -> Objective:
    """The objective a job's config entry (an ``AdapterJob``) names, with its settings."""
    return JOB_OBJECTIVES[spec.objective].build(spec)


def client_objective(loss: str, config: Mapping[str, float] | None = None) -> Objective:
    """A service client's loss by Tinker's name (a key of :data:`CLIENT_LOSSES`) with its
    ``loss_fn_config``."""
    return PerTokenLoss(loss, config)

"""One optimizer per adapter slot: its AdamW settings, LR schedule, clipping and step count.

megatron-core's optimizer steps every trainable parameter with one set of settings; here
each adapter has its own, starts, steps, clips and is reset on its own, while the arithmetic
runs for all the slots that step at once (:mod:`.slot_adamw`). Gradients come from
``main_grad`` (fp32, already reduced over data-parallel ranks by ``grad_sync.SlotGradSync``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_multilora.layers.lifecycle import ModelOrChunks
from megatron_multilora.training.config import AdapterJob
from megatron_multilora.training.step.slot_adamw import SlotAdamW, SlotUpdate


def lr_factor(step: int, job: AdapterJob, total_steps: int) -> float:
    """Multiplier of ``job.lr`` at optimizer step ``step`` (0-based): linear warmup, then
    constant, linear or cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    if step < job.warmup_steps:
        return (step + 1) / job.warmup_steps
    if job.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - job.warmup_steps) / max(1, total_steps - job.warmup_steps))
    floor = job.min_lr_ratio
    if job.schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class SlotOptimizer:
    """One slot's AdamW settings, LR schedule and step count; its master weights and moments
    are rows of the step's :class:`.slot_adamw.SlotAdamW`, which steps every slot at once
    (:meth:`update` is this slot's part of that step)."""

    def __init__(self, model: ModelOrChunks, slot: int, job: AdapterJob, total_steps: int) -> None:
        self.adamw = adamw = SlotAdamW.of(model)
        self.slot, self.job, self.total_steps = slot, job, total_steps
        self.params = adamw.rows.params[slot]
        self.base_lr, self.betas, self.eps = job.lr, (0.9, 0.999), 1e-8
        self.weight_decay, self.grad_clip = job.weight_decay, job.grad_clip
        self.steps = 0  # AdamW steps taken (its bias corrections' count)
        self.schedule_steps = 0  # LR schedule position
        self.lr = job.lr * lr_factor(0, job, total_steps)
        adamw.start(slot)

    def move_to(self, slot: int) -> None:
        """Its adapter was paged into ``slot`` (with its masters and moments)."""
        self.slot, self.params = slot, self.adamw.rows.params[slot]

    def update(self, grad_norm: float) -> SlotUpdate:
        """This slot's part of the next AdamW step, clipping by its gradient norm, and the
        schedule advanced past it."""
        clip = self.grad_clip
        self.steps += 1
        update = SlotUpdate(
            lr=self.lr,
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
            step=self.steps,
            clip=min(1.0, clip / (grad_norm + 1e-6)) if clip else 1.0,
        )
        self.schedule_steps += 1
        self.lr = self.base_lr * lr_factor(self.schedule_steps, self.job, self.total_steps)
        return update

    def set_hyperparameters(
        self,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        grad_clip: float | None,
    ) -> None:
        """The next step's AdamW settings and clipping (a client that sends them with every
        step, as Tinker's do; the schedule is then not used)."""
        self.base_lr, self.lr, self.betas, self.eps = lr, lr, betas, eps
        self.weight_decay, self.grad_clip = weight_decay, grad_clip

    def master_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        """``param``'s fp32 master weight (``param``'s own values when it is fp32)."""
        return self.adamw.segment("param", param)

    def state_of(self, param: torch.nn.Parameter, key: str) -> torch.Tensor:
        """AdamW's ``key`` moment for ``param`` (zeros before the first step)."""
        return self.adamw.segment(key, param)

    def scalar_state(self) -> dict[str, Any]:
        """Everything but the moments: the step count and the schedule (the fields of torch's
        LambdaLR state that earlier checkpoints hold)."""
        return {
            "adam_step": float(self.steps),
            "scheduler": {
                "base_lrs": [self.base_lr],
                "last_epoch": self.schedule_steps,
                "_last_lr": [self.lr],
            },
        }

    def load(
        self,
        scalar: dict[str, Any],
        moments: dict[str, dict[torch.nn.Parameter, torch.Tensor]],
        masters: dict[torch.nn.Parameter, torch.Tensor] | None = None,
    ) -> None:
        """Restore from :meth:`scalar_state` (or an earlier checkpoint's), per-parameter
        moments and, for parameters that are not fp32, their saved fp32 master weights
        (default: the parameters' values)."""
        self.adamw.start(self.slot)
        with torch.no_grad():
            for param in self.params:
                if masters is not None and param.dtype != torch.float32:
                    self.master_of(param).copy_(masters[param])
                if scalar["adam_step"] > 0:
                    for key in ("exp_avg", "exp_avg_sq"):
                        self.state_of(param, key).copy_(moments[key][param])
        self.steps = int(scalar["adam_step"])
        schedule = scalar["scheduler"]
        self.base_lr = schedule["base_lrs"][0]
        self.schedule_steps = int(schedule["last_epoch"])
        self.lr = schedule["_last_lr"][0]

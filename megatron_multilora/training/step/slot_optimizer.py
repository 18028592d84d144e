"""One optimizer per adapter slot: AdamW on fp32 master weights, an LR schedule, the
slot's own gradient norm and clipping.

megatron-core's optimizer steps every trainable parameter at once; here each adapter steps,
clips and is reset on its own, so a plain torch AdamW per slot is used. Gradients come from
``main_grad`` (fp32, already reduced over data-parallel ranks by ``grad_sync.SlotGradSync``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_multilora.training.config import AdapterJob


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


def _grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    return getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad


def slot_grad_norms(params_by_slot: dict[int, list[torch.nn.Parameter]]) -> dict[int, float]:
    """The L2 norm of each slot's whole gradient, over all its TP and EP shards and pipeline
    stages (so clipping uses the adapter's global norm).

    TP-split factors add their shards over the TP group; TP-replicated factors (identical on
    every TP rank after gradient finalisation) count once; expert factors add their experts
    over the EP group; each pipeline stage adds its own layers. Every rank gets the same
    values. All slots share each reduction and one read back to the host; each slot's sum is
    computed as it would be alone.
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    slots = list(params_by_slot)
    groups = []  # per slot: (split, replicated, expert) gradients
    for slot in slots:
        split, replicated, expert = [], [], []
        for p in params_by_slot[slot]:
            g = _grad(p)
            if g is None:
                continue
            if not getattr(p, "allreduce", True):
                expert.append(g)
            elif getattr(p, "tensor_model_parallel", False):
                split.append(g)
            else:
                replicated.append(g)
        groups.append((split, replicated, expert))
    if not slots:
        return {}
    grads = [g for group in groups for kind in group for g in kind]
    device = grads[0].device if grads else torch.device("cpu")
    # One norm kernel over every slot's tensors, squared at once and summed per slot and kind
    # on the device, read back once: no per-parameter or per-slot device-to-host sync.
    squares = (
        torch.stack(torch._foreach_norm([g.float() for g in grads])).pow(2)
        if grads
        else torch.zeros(0, dtype=torch.float32, device=device)
    )
    sums = [
        chunk.sum() for chunk in squares.split([len(kind) for group in groups for kind in group])
    ]
    dense = torch.stack(
        [split + replicated / tp for split, replicated in zip(sums[0::3], sums[1::3])]
    )
    experts = torch.stack(sums[2::3])
    if tp > 1:
        dist.all_reduce(dense, group=parallel_state.get_tensor_model_parallel_group())
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        dist.all_reduce(experts, group=parallel_state.get_expert_model_parallel_group())
    total = dense + experts
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return dict(zip(slots, total.sqrt().tolist()))


class SlotOptimizer:
    """AdamW and LR schedule for one slot's parameters, stepping fp32 master weights."""

    def __init__(self, params: list[torch.nn.Parameter], job: AdapterJob, total_steps: int) -> None:
        self.params, self.job, self.total_steps = params, job, total_steps
        self.grad_clip = job.grad_clip
        # fp32 parameters are their own masters; bf16 ones get fp32 copies.
        self.masters = [
            p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float().clone())
            for p in params
        ]
        self._master_of = {id(p): m for p, m in zip(params, self.masters)}
        # fused: one kernel over the slot's tensors instead of a Python loop per tensor.
        self.optimizer = torch.optim.AdamW(
            self.masters, lr=job.lr, weight_decay=job.weight_decay, fused=True
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, job, total_steps)
        )

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def step(self, grad_norm: float) -> None:
        """Clip by the slot's norm, take one AdamW step, advance the schedule."""
        clip = self.grad_clip
        coef = min(1.0, clip / (grad_norm + 1e-6)) if clip else 1.0
        grads = [_grad(param).float() for param in self.params]  # the fp32 buffers themselves
        if coef != 1.0:
            # In place and in one call for the slot (not a scaled copy per tensor): the
            # gradients are zeroed before they are accumulated again.
            torch._foreach_mul_(grads, coef)
        for master, grad in zip(self.masters, grads):
            master.grad = grad
        self.optimizer.step()
        self.scheduler.step()
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                master.grad = None
                if master is not param:
                    param.copy_(master)

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
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.scheduler.base_lrs = [lr for _ in self.scheduler.base_lrs]
        self.grad_clip = grad_clip

    def zero_grad(self) -> None:
        for param in self.params:
            grad = _grad(param)
            if grad is not None:
                grad.zero_()

    def master_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        """``param``'s fp32 master weight (``param`` itself when it is fp32)."""
        return self._master_of[id(param)]

    def state_of(self, param: torch.nn.Parameter, key: str) -> torch.Tensor:
        """AdamW's ``key`` moment for ``param`` (zeros before the first step)."""
        master = self._master_of[id(param)]
        state = self.optimizer.state.get(master, {})
        return state[key] if key in state else torch.zeros_like(master, dtype=torch.float32)

    def scalar_state(self) -> dict[str, Any]:
        """Everything but the moments: step counts and the scheduler."""
        steps = [float(s["step"]) for s in self.optimizer.state.values() if "step" in s]
        return {"adam_step": steps[0] if steps else 0.0, "scheduler": self.scheduler.state_dict()}

    def load(
        self,
        scalar: dict[str, Any],
        moments: dict[str, dict[torch.nn.Parameter, torch.Tensor]],
        masters: dict[torch.nn.Parameter, torch.Tensor] | None = None,
    ) -> None:
        """Restore from :meth:`scalar_state`, per-parameter moments and, for parameters
        that are not fp32, their saved fp32 master weights (default: the parameters' values)."""
        for param, master in zip(self.params, self.masters):
            if master is not param:
                master.data.copy_(param.detach().float() if masters is None else masters[param])
        # Through torch's own loading, which puts each value where this optimizer keeps it
        # (the fused kernel wants ``step`` on the parameters' device, e.g. the GPU).
        state = self.optimizer.state_dict()
        if scalar["adam_step"] > 0:
            state["state"] = {
                i: {
                    "step": torch.tensor(scalar["adam_step"]),
                    "exp_avg": moments["exp_avg"][param].float().clone(),
                    "exp_avg_sq": moments["exp_avg_sq"][param].float().clone(),
                }
                for i, param in enumerate(self.params)
            }
        self.optimizer.load_state_dict(state)
        self.scheduler.load_state_dict(scalar["scheduler"])
        # The scheduler's state holds the lr it last set; the optimizer still has the step-0
        # value from construction, which the next step would use.
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr

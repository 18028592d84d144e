"""AdamW for the slots that step, over the rows of :mod:`.slot_rows`' matrices.

On an accelerator, bound by its kernel launches (``stacked``), one update for every slot
with each slot's hyperparameters (lr, betas, eps, weight decay, clipping) as a column: a
fixed number of tensor ops whatever the number of slots and layers, and no read back to the
host. Each slot's scalars (its bias corrections, its clipping factor from the norms the
step has read anyway) are computed on the host in double precision, as
``torch.optim.AdamW`` computes them, and the update follows its single-tensor arithmetic op
for op; rows of slots that do not step are written back unchanged (bit for bit).

On the CPU, bound by memory bandwidth, that chain of ops costs a pass over every slot's rows
per op; there each stepping slot takes torch's fused kernel over its own rows (one pass), as
``torch.optim.AdamW(fused=True)`` does.

fp32 parameters are their own master weights; bf16 ones step fp32 copies.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_multilora.layers.lifecycle import ModelOrChunks, model_chunks
from megatron_multilora.ops.host_values import on_device
from megatron_multilora.training.step.slot_rows import SlotRows

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class SlotUpdate:
    """One slot's settings for one AdamW step (``step``: its 1-based step count; ``clip``:
    the factor its gradients are scaled by, 1.0 for none)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    step: int
    clip: float


class SlotAdamW:
    """The master weights and moments of every slot, in ``rows``' layout (which this makes
    hold the parameters)."""

    def __init__(self, rows: SlotRows, stacked: bool | None = None) -> None:
        rows.hold_parameters()
        self.rows = rows
        # Stacked on accelerators (bound by launches); on the CPU, bound by memory, torch's
        # fused kernel per slot (one pass over the slot's rows instead of one per op:
        # benchmarks/README.md, rows 14).
        self.stacked = rows.grad_buffer.device.type != "cpu" if stacked is None else stacked
        values = rows.values
        self.masters = (
            values
            if all(v.dtype == torch.float32 for v in values.values())
            else {name: v.float() for name, v in values.items()}
        )
        self.moments = {
            m: {name: torch.zeros_like(v) for name, v in self.masters.items()} for m in MOMENTS
        }

    @classmethod
    def of(cls, model: ModelOrChunks) -> SlotAdamW:
        """The one of ``model`` (a model or its chunks), made on first use: the parameter
        matrices belong to the model, whichever step or optimizer asks."""
        first = model_chunks(model)[0]
        if "_slot_adamw" not in first.__dict__:
            first.__dict__["_slot_adamw"] = cls(SlotRows(model_chunks(model)))
        return first.__dict__["_slot_adamw"]

    def start(self, slot: int) -> None:
        """A fresh optimizer for ``slot``: masters from its parameters, zero moments."""
        self.ensure_held()
        with torch.no_grad():
            for name, values in self.rows.values.items():
                if self.masters[name] is not values:
                    self.masters[name][slot].copy_(values[slot])
                for moment in MOMENTS:
                    self.moments[moment][name][slot].zero_()

    def ensure_held(self) -> None:
        """Point the parameters at the matrices again if something re-pointed them (e.g. a
        ``module.to()``), keeping their values."""
        if not self.rows.holds_parameters():
            self.rows.hold_parameters()
            if self.masters is not self.rows.values and all(
                v.dtype == torch.float32 for v in self.rows.values.values()
            ):
                self.masters = self.rows.values

    def segment(self, which: str, param: torch.nn.Parameter) -> torch.Tensor:
        """``param``'s part of the masters (``"param"``) or of a moment (a view)."""
        slot, i = self.rows.position(param)
        matrices = self.masters if which == "param" else self.moments[which]
        return self.rows.segment(matrices, slot, i)

    @torch.no_grad()
    def step(self, updates: dict[int, SlotUpdate]) -> None:
        """One AdamW step of the slots in ``updates``: all at once (``stacked``), or each
        slot's rows by torch's fused kernel."""
        if not updates:
            return
        self.ensure_held()
        if not self.stacked:
            for slot, update in updates.items():
                self._fused_step(slot, update)
            return
        # Per stepping slot, as torch.optim.AdamW computes them in Python: clipping factor,
        # decay, 1 - beta1, beta2, 1 - beta2, sqrt of the second bias correction, -step
        # size, eps. Only those slots' rows are read and written: the temporaries are sized
        # by the slots that step, not by every slot.
        slots = sorted(updates)
        cols: list[list[float]] = [[] for _ in range(8)]
        for s in slots:
            u = updates[s]
            beta1, beta2 = u.betas
            values = (
                u.clip,
                1 - u.lr * u.weight_decay,
                1 - beta1,
                beta2,
                1 - beta2,
                (1 - beta2**u.step) ** 0.5,
                -u.lr / (1 - beta1**u.step),
                u.eps,
            )
            for c, value in enumerate(values):
                cols[c].append(value)
        device = next(iter(self.masters.values())).device
        table = on_device([v for col in cols for v in col], torch.float32, device)
        clip, decay, w1, beta2, one_minus_beta2, bc2_sqrt, neg_step_size, eps = table.view(
            8, len(slots), 1
        )
        # The same ops whether one slot steps or all of them.
        index = on_device(slots, torch.int64, device)

        def rows(matrix: torch.Tensor) -> torch.Tensor:
            return matrix.index_select(0, index)

        def write(matrix: torch.Tensor, new: torch.Tensor) -> None:
            matrix.index_copy_(0, index, new.to(matrix.dtype))

        for name, master in self.masters.items():
            if not master.numel():
                continue
            exp_avg, exp_avg_sq = (self.moments[m][name] for m in MOMENTS)
            grad = rows(self.rows.grads[name]) * clip
            new_master = rows(master) * decay
            new_avg = torch.lerp(rows(exp_avg), grad, w1)
            # addcmul/addcdiv with the scalar folded into an operand: torch's own kernels,
            # so the same rounding as its ``value=`` forms
            new_avg_sq = torch.addcmul(rows(exp_avg_sq) * beta2, one_minus_beta2 * grad, grad)
            denom = new_avg_sq.sqrt() / bc2_sqrt + eps
            new_master = torch.addcdiv(new_master, neg_step_size * new_avg, denom)
            write(master, new_master)
            write(exp_avg, new_avg)
            write(exp_avg_sq, new_avg_sq)
            values = self.rows.values[name]
            if values is not master:
                write(values, new_master.to(values.dtype))

    def _fused_step(self, slot: int, u: SlotUpdate) -> None:
        """``slot``'s AdamW step by ``torch._fused_adamw_`` over its rows (what
        ``torch.optim.AdamW(fused=True)`` runs); its gradients are scaled in place to clip."""
        names = [name for name, master in self.masters.items() if master.numel()]
        masters = [self.masters[name][slot] for name in names]
        grads = [self.rows.grads[name][slot] for name in names]
        if u.clip != 1.0:
            torch._foreach_mul_(grads, u.clip)
        step = torch.tensor(float(u.step), device=masters[0].device)
        torch._fused_adamw_(
            masters,
            grads,
            [self.moments["exp_avg"][name][slot] for name in names],
            [self.moments["exp_avg_sq"][name][slot] for name in names],
            [],
            [step] * len(names),
            lr=u.lr,
            beta1=u.betas[0],
            beta2=u.betas[1],
            weight_decay=u.weight_decay,
            eps=u.eps,
            amsgrad=False,
            maximize=False,
        )
        for name, master in zip(names, masters):
            values = self.rows.values[name][slot]
            if values.data_ptr() != master.data_ptr():
                values.copy_(master)

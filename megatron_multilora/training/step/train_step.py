"""One training step of N adapters at once, with per-adapter loss normalisation.

pack -> agree the micro-batch count, each adapter's loss-token count and the caller's extra
integers (one collective, :func:`.micro_batches.agree`) -> equalise -> forward/backward through
megatron's schedule (:mod:`.schedule`) -> per-slot gradient sync (the loss reduction
overlapping it) -> per-slot gradient norms (over every TP/EP shard and pipeline stage, all
slots at once) -> non-finite isolation -> each slot's clipped optimizer step.

An adapter's loss is the mean over *its own* loss tokens in its global batch (all
micro-batches, all data-parallel ranks): its gradients do not depend on which other adapters
share the micro-batches. The per-adapter token counts are agreed before the backward passes,
and gradients are summed (not averaged) over data-parallel ranks (see :mod:`.grad_sync`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_multilora.data.datasets import Packable
from megatron_multilora.data.packing import MicroBatch
from megatron_multilora.layers.lifecycle import ModelOrChunks, model_chunks
from megatron_multilora.parallel import collective_device
from megatron_multilora.training.objectives.objective import Objective
from megatron_multilora.training.step.grad_sync import SlotGradSync
from megatron_multilora.training.step.micro_batches import MicroBatcher, agree
from megatron_multilora.training.step.schedule import per_slot_results
from megatron_multilora.training.step.slot_optimizer import SlotOptimizer, slot_grad_norms


def start_reducing_losses(per_slot: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Sum per-adapter losses over data-parallel ranks (each rank held part of the batch),
    started without waiting (the step overlaps it with the gradient reduction, so the two
    cost the ranks one meeting); call the result for the losses."""
    if parallel_state.get_data_parallel_world_size() == 1:
        return per_slot.cpu
    per_slot = per_slot.to(collective_device())
    work = dist.all_reduce(per_slot, group=parallel_state.get_data_parallel_group(), async_op=True)

    def reduced() -> torch.Tensor:
        work.wait()
        return per_slot.cpu()

    return reduced


@dataclasses.dataclass
class StepResult:
    """What one step did: every adapter's loss over its global batch (``[n_slots]``, the
    same on every rank) and its objective's metrics (``[n_slots, MAX_METRICS]``, in the
    order of ``Objective.metrics``), the gradient norm of each slot that stepped, the slots
    skipped for a non-finite loss or gradient, each adapter's loss units (``[n_slots]``),
    and the extras agreed before the step (the world's max of each)."""

    losses: torch.Tensor
    metrics: torch.Tensor
    grad_norms: dict[int, float]
    skipped: set[int]
    loss_units: torch.Tensor
    extras: tuple[int, ...] = ()


class SlotTrainStep:
    """The training step of every adapter slot of ``model`` (a model or its chunks).

    Packs each slot's examples into micro-batches of at most ``token_budget`` positions
    (padded to a multiple of ``pad_multiple``, e.g. the sequence-parallel size) and runs
    :meth:`__call__`. Owns the slots' fp32 gradient buffers (:class:`SlotGradSync`).
    """

    def __init__(
        self, model: ModelOrChunks, n_slots: int, token_budget: int, pad_multiple: int, pad_id: int
    ) -> None:
        self.model = model_chunks(model)
        self.n_slots = n_slots
        self.grad_sync = SlotGradSync(self.model)
        self.batcher = MicroBatcher(self.model, n_slots, token_budget, pad_multiple, pad_id)

    def losses(
        self,
        micro_batches: list[MicroBatch],
        loss_units: torch.Tensor,
        forward_only: bool = False,
        objectives: dict[int, Objective] | None = None,
    ) -> torch.Tensor:
        """Each adapter's loss over the global batch (reduced over data-parallel ranks, on
        every stage); with ``forward_only=False`` its gradients accumulate in ``main_grad``."""
        return start_reducing_losses(
            per_slot_results(
                self.model, micro_batches, loss_units, forward_only, self._per_slot(objectives)
            )
        )()[:, 0]

    def _per_slot(self, objectives: dict[int, Objective] | None) -> list[Objective | None]:
        return [(objectives or {}).get(s) for s in range(self.n_slots)]

    def __call__(
        self,
        slot_examples: Sequence[Sequence[Packable]],
        optimizers: dict[int, SlotOptimizer],
        slot_order: Sequence[int] | None = None,
        micro_batches: list[MicroBatch] | None = None,
        extras: Sequence[int] = (),
        objectives: dict[int, Objective] | None = None,
    ) -> StepResult:
        """One step of the slots in ``optimizers`` on this rank's ``slot_examples`` (its
        data-parallel share of each slot's global batch); ``micro_batches``: their packing
        when already done (equalised). ``extras`` are agreed over all ranks in the step's
        first collective and come back in the result. ``objectives``: each slot's objective
        (default the registry's DEFAULT). Every rank of the world must call it.

        A slot whose loss or gradient norm is not finite is left out: the step is redone
        without the adapters found to fail on their own samples, and they do not step.
        Every rank takes the same decisions (losses come from the last stage, norms are
        global).
        """
        # Fillers and pads carry no loss tokens, so unpadded micro-batches count the same.
        if micro_batches is None:
            local = self.batcher.pack(slot_examples, (), slot_order)
            agreed = agree(local, self.n_slots, extras)
            micro_batches = self.batcher.equalize(local, agreed.micro_batches)
        else:
            agreed = agree(micro_batches, self.n_slots, extras)
        loss_units = agreed.loss_units
        per_slot = self._per_slot(objectives)
        skipped: set[int] = set()
        while True:
            # Only the training slots' gradients are reset and reduced: free slots cost nothing.
            self.grad_sync.zero_grad(optimizers)
            reduced = start_reducing_losses(
                per_slot_results(self.model, micro_batches, loss_units, objectives=per_slot)
            )
            stepping = [s for s in optimizers if s not in skipped]
            self.grad_sync.sync(stepping)
            table = reduced()
            losses = table[:, 0]
            norms = slot_grad_norms({s: optimizers[s].params for s in stepping})
            failing = {
                s
                for s, norm in norms.items()
                if not (math.isfinite(norm) and math.isfinite(float(losses[s])))
            }
            if not failing:
                break
            # A non-finite adapter can poison the others through masked attention (0 * inf):
            # find which fail on their own samples, and redo the step without them.
            skipped |= self._failing_alone(
                slot_examples, loss_units, failing, slot_order, objectives
            )
            micro_batches = self.batcher.ready(slot_examples, skipped, slot_order)
        for s in stepping:
            optimizers[s].step(norms[s])
        return StepResult(losses, table[:, 1:], norms, skipped, loss_units, agreed.extras)

    def _failing_alone(
        self,
        slot_examples: Sequence[Sequence[Packable]],
        loss_units: torch.Tensor,
        candidates: set[int],
        slot_order: Sequence[int] | None,
        objectives: dict[int, Objective] | None,
    ) -> set[int]:
        """The candidates whose loss is non-finite on their own samples (all of them when
        none is, i.e. only their combination fails)."""
        culprits = set()
        for slot in sorted(candidates):
            alone = self.batcher.ready(slot_examples, set(range(self.n_slots)) - {slot}, slot_order)
            if not math.isfinite(float(self.losses(alone, loss_units, True, objectives)[slot])):
                culprits.add(slot)
        return culprits or set(candidates)

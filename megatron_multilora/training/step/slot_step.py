"""The one step of N adapter slots, for every front: the trainer's jobs and the service's
clients hand it per-slot work (:class:`SlotWork`: a slot's global batch and its objective),
and it runs all of it at once.

:meth:`SlotStep.train`: shard each slot's global batch over the data-parallel ranks -> pack
-> agree the micro-batch count, each slot's loss units and the caller's extra integers (one
collective, :func:`.micro_batches.agree`) -> equalise -> forward/backward through megatron's
schedule (:mod:`.schedule`) -> loss reduction over the data-parallel ranks (overlapping the
gradient sync) -> non-finite isolation -> for the slots that step: one gradient sync, one
norm pass for all of them (every TP/EP shard and pipeline stage), each slot's clipped
optimizer step. A slot given no optimizer keeps its gradients (they add up over calls) until
:meth:`SlotStep.apply` steps it: a service client's ``forward_backward`` calls, then its
``optim_step``. :meth:`SlotStep.forward` is the same pass forward only (evaluation, a
client's ``forward``). Sampling is :mod:`.objective_tools`' (GRPO's rollouts, a client's
``sample``).

A slot's loss is its objective's over its own items: the mean over its loss units in the
global batch (a trainer's job) or their sum (a service client's, as Tinker's). Gradients are
summed, not averaged, over data-parallel ranks (see :mod:`.grad_sync`), so a slot's
gradients do not depend on which other slots share the pass. A slot whose loss or gradients
are not finite is left out: the pass is redone without the slots found to fail on their own
items (a non-finite adapter can poison the others through masked attention, 0 * inf), so the
others' results are those of the pass without it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_multilora.data.datasets import Packable, examples_of
from megatron_multilora.layers.lifecycle import ModelOrChunks, model_chunks
from megatron_multilora.parallel import collective_device
from megatron_multilora.training.objectives.objective import Objective
from megatron_multilora.training.objectives.registry import DEFAULT
from megatron_multilora.training.step.cuda_graphs import ChunkGraphs, graph_lengths
from megatron_multilora.training.step.grad_sync import SlotGradSync
from megatron_multilora.training.step.micro_batches import (
    MicroBatch,
    MicroBatcher,
    agree,
    shard_for_data_parallel,
)
from megatron_multilora.training.step.schedule import (
    eval_mode,
    per_slot_results,
    per_slot_results_and_data,
)
from megatron_multilora.training.step.slot_adamw import SlotAdamW
from megatron_multilora.training.step.slot_optimizer import SlotOptimizer


@dataclasses.dataclass
class SlotWork:
    """One slot's part of a call: its items of the global batch (every rank passes the same;
    the step takes this rank's share), its objective, whether its loss is the mean over its
    loss units (else their sum) and, where it steps in this call, its optimizer."""

    items: Sequence[Packable]
    objective: Objective
    optimizer: SlotOptimizer | None = None
    mean: bool = True


@dataclasses.dataclass
class StepResult:
    """What a call did: every slot's loss over its global batch (``[n_slots]``, the same on
    every rank) and its objective's metrics (``[n_slots, MAX_METRICS]``, in the order of
    ``Objective.metrics``), the gradient norm of each slot that stepped, the slots left out
    for a non-finite loss or gradient, each slot's loss units over the global batch, the
    extras agreed before the pass (the world's max of each), and for each name asked to keep
    (``"logprobs"``, ``"choices"``) per slot, per example of its global batch in order, the
    value at each of its positions (``schedule.per_slot_results_and_data``)."""

    losses: torch.Tensor
    metrics: torch.Tensor
    grad_norms: dict[int, float]
    skipped: set[int]
    loss_units: torch.Tensor
    extras: tuple[int, ...] = ()
    kept: dict[str, dict[int, list[list]]] = dataclasses.field(default_factory=dict)


def slot_work(
    slot_items: Sequence[Sequence[Packable]],
    optimizers: dict[int, SlotOptimizer],
    objectives: dict[int, Objective] | None = None,
) -> dict[int, SlotWork]:
    """The work of the slots of ``optimizers`` for a caller holding a list of every slot's
    items (a benchmark, a test): each slot's items, objective (default the registry's) and
    optimizer."""
    return {
        s: SlotWork(slot_items[s], (objectives or {}).get(s) or DEFAULT(), opt)
        for s, opt in optimizers.items()
    }


def start_reducing_losses(per_slot: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Sum per-slot losses over data-parallel ranks (each rank held part of the batch),
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


class SlotStep:
    """The step of every adapter slot of ``model`` (a model or its chunks): micro-batches of
    at most ``token_budget`` positions, padded to a multiple of ``pad_multiple`` (the
    sequence-parallel size). Owns the slots' fp32 gradient buffers (:class:`SlotGradSync`).
    ``cuda_graphs``: training passes replay captures (``cuda_graphs.ChunkGraphs``), whose
    attention takes sequences of at most ``max_seq_len`` positions."""

    def __init__(
        self,
        model: ModelOrChunks,
        n_slots: int,
        token_budget: int,
        pad_multiple: int,
        pad_id: int,
        cuda_graphs: bool = False,
        max_seq_len: int | None = None,
    ) -> None:
        self.model = model_chunks(model)
        self.n_slots = n_slots
        self.adamw = SlotAdamW.of(self.model)
        self.grad_sync = SlotGradSync(self.adamw.rows)
        # CUDA graphs: training passes replay captures of a few padded lengths.
        self.graphs = (
            ChunkGraphs(self.model[0], self.adamw.rows, max_seq_len) if cuda_graphs else None
        )
        lengths = graph_lengths(token_budget) if cuda_graphs else ()
        self.batcher = MicroBatcher(
            self.model, n_slots, token_budget, pad_multiple, pad_id, lengths
        )
        self._accumulated: set[int] = set()  # slots holding gradients not yet applied

    # ----- what every front calls ---------------------------------------------------------

    def train(
        self,
        work: dict[int, SlotWork],
        slot_order: Sequence[int] | None = None,
        extras: Sequence[int] = (),
        keep: Sequence[str] = (),
        micro_batches: list[MicroBatch] | None = None,
    ) -> StepResult:
        """Forward and backward of every slot's work in one pass; the slots with an
        optimizer step. ``slot_order``: the packing order (``micro_batches.pack_micro_batches``); ``extras``
        are agreed over all ranks in the call's first collective; ``micro_batches``: this
        rank's packing of the work when already done (equalised; a benchmark times the pass
        alone). Every rank of the world must call it with the same work; every rank takes
        the same decisions."""
        shares = self._shares(work)
        if micro_batches is None:
            local = self.batcher.pack(shares, (), slot_order)
            agreed = agree(local, self.n_slots, extras)
            micro_batches = self.batcher.equalize(local, agreed.micro_batches)
        else:
            agreed = agree(micro_batches, self.n_slots, extras)
        units = self._denominators(work, agreed.loss_units)
        objectives = [work[s].objective if s in work else None for s in range(self.n_slots)]
        stepping = {s: w.optimizer for s, w in work.items() if w.optimizer is not None}
        accumulating = [s for s, w in work.items() if w.optimizer is None]
        before = self.grad_sync.save([s for s in accumulating if s in self._accumulated])
        skipped: set[int] = set()
        while True:
            # Only these slots' gradients are reset and reduced: free slots cost nothing.
            self.grad_sync.zero_grad([*stepping, *accumulating])
            self.grad_sync.load(before)
            table, kept = per_slot_results_and_data(
                self.model,
                micro_batches,
                units,
                objectives=objectives,
                keep=keep,
                graphs=self.graphs,
            )
            reduced = start_reducing_losses(table)
            steps = [s for s in stepping if s not in skipped]
            self.grad_sync.sync(steps)
            table = reduced()
            # Stepping slots' norms are global; kept ones' are this rank's (their gradients
            # are reduced when applied), so their finiteness is agreed over the DP ranks.
            all_norms = self.grad_sync.norms().tolist()
            kept_grads = [s for s in accumulating if s not in skipped]
            finite = self._finite(all_norms, table[:, 0].tolist(), kept_grads)
            norms = {s: all_norms[s] for s in steps}
            failing = {s for s in [*steps, *kept_grads] if not finite[s]}
            if not failing:
                break
            skipped |= self._failing_alone(shares, units, failing, slot_order, objectives)
            micro_batches = self.batcher.ready(shares, skipped, slot_order)
        self.adamw.step({s: stepping[s].update(norms[s]) for s in steps})
        self._accumulated |= set(kept_grads)
        return StepResult(
            table[:, 0],
            table[:, 1:],
            norms,
            skipped,
            agreed.loss_units,
            agreed.extras,
            self._gathered(kept, {s: w for s, w in work.items() if s not in skipped}),
        )

    def forward(self, work: dict[int, SlotWork], keep: Sequence[str] = ()) -> StepResult:
        """The same pass forward only (eval mode, no gradients): each slot's loss and metrics
        over its global batch (nan where it has no loss units)."""
        shares = self._shares(work)
        local = self.batcher.pack(shares)
        agreed = agree(local, self.n_slots)
        micro_batches = self.batcher.equalize(local, agreed.micro_batches)
        objectives = [work[s].objective if s in work else None for s in range(self.n_slots)]
        with eval_mode(self.model):
            table, kept = per_slot_results_and_data(
                self.model,
                micro_batches,
                self._denominators(work, agreed.loss_units),
                forward_only=True,
                objectives=objectives,
                keep=keep,
            )
        table = start_reducing_losses(table)()
        table = torch.where((agreed.loss_units > 0)[:, None], table, torch.nan)
        return StepResult(
            table[:, 0], table[:, 1:], {}, set(), agreed.loss_units, (), self._gathered(kept, work)
        )

    def apply(self, optimizers: dict[int, SlotOptimizer]) -> tuple[dict[int, float], set[int]]:
        """Step the slots whose gradients :meth:`train` accumulated: one sync, one norm pass
        for all of them; returns their gradient norms and the slots that did not step (not
        finite). Their gradients are dropped either way."""
        slots = list(optimizers)
        self.grad_sync.sync(slots)
        all_norms = self.grad_sync.norms().tolist()
        norms = {s: all_norms[s] for s in slots}
        skipped = {s for s in slots if not math.isfinite(norms[s])}
        self.adamw.step({s: optimizers[s].update(norms[s]) for s in slots if s not in skipped})
        self.drop(slots)
        return norms, skipped

    def drop(self, slots: Sequence[int]) -> None:
        """Forget the slots' gradients (applied, or their client is gone)."""
        self.grad_sync.zero_grad(slots)
        self._accumulated -= set(slots)

    # ----- the pass's parts -----------------------------------------------------------------

    def losses(
        self,
        micro_batches: list[MicroBatch],
        loss_units: torch.Tensor,
        forward_only: bool = False,
        objectives: Sequence[Objective | None] | None = None,
    ) -> torch.Tensor:
        """Each slot's loss over ready micro-batches (reduced over data-parallel ranks, on
        every stage); with ``forward_only=False`` its gradients accumulate in ``main_grad``."""
        return start_reducing_losses(
            per_slot_results(self.model, micro_batches, loss_units, forward_only, objectives)
        )()[:, 0]

    def _shares(self, work: dict[int, SlotWork]) -> list[list[Packable]]:
        rank = parallel_state.get_data_parallel_rank()
        world = parallel_state.get_data_parallel_world_size()
        return [
            shard_for_data_parallel(work[s].items, rank, world) if s in work else []
            for s in range(self.n_slots)
        ]

    def _denominators(self, work: dict[int, SlotWork], loss_units: torch.Tensor) -> torch.Tensor:
        """What each slot's loss sums are divided by: its loss units (a mean), or 1 (a sum)."""
        units = loss_units.clone()
        for s, w in work.items():
            if not w.mean:
                units[s] = 1
        return units

    def _finite(self, norms: list[float], losses: list[float], kept: list[int]) -> list[bool]:
        """Per slot, whether its loss and gradient norm are finite (``kept`` slots' norms
        are each rank's own: they must be finite on every rank)."""
        finite = [math.isfinite(n) and math.isfinite(x) for n, x in zip(norms, losses)]
        if kept and parallel_state.get_data_parallel_world_size() > 1:
            bad = torch.tensor([float(not finite[s]) for s in kept], device=collective_device())
            dist.all_reduce(
                bad, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group()
            )
            for s, b in zip(kept, bad.tolist()):
                finite[s] = not b
        return finite

    def _failing_alone(
        self,
        shares: list[list[Packable]],
        units: torch.Tensor,
        candidates: set[int],
        slot_order: Sequence[int] | None,
        objectives: Sequence[Objective | None],
    ) -> set[int]:
        """The candidates whose loss is non-finite on their own items (all of them when
        none is, i.e. only their combination fails)."""
        culprits = set()
        for slot in sorted(candidates):
            alone = self.batcher.ready(shares, set(range(self.n_slots)) - {slot}, slot_order)
            if not math.isfinite(float(self.losses(alone, units, True, objectives)[slot])):
                culprits.add(slot)
        return culprits or set(candidates)

    def _gathered(self, kept: dict[str, list], work: dict[int, SlotWork]) -> dict[str, dict]:
        """What the pass kept per example of this rank's share, per slot of ``work``, as every
        rank's shares reassembled into each slot's global batch order."""
        world = parallel_state.get_data_parallel_world_size()
        out: dict[str, dict[int, list[list]]] = {}
        for name, per_slot in kept.items():
            everyone = [per_slot]
            if world > 1:
                everyone = [None] * world
                dist.all_gather_object(
                    everyone, per_slot, group=parallel_state.get_data_parallel_group()
                )
            out[name] = {}
            for s, w in work.items():
                ranks = [iter(share[s]) for share in everyone]  # each rank's in packing order
                out[name][s] = [
                    next(ranks[i % world])
                    for i, item in enumerate(w.items)
                    for _ in examples_of(item)
                ]
        return out

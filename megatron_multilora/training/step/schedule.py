"""A step's packed micro-batches through megatron's pipeline schedules, for every PP size.

``get_forward_backward_func()`` runs the forward and backward passes (PP=1 included, so one
code path serves every layout): each model chunk (one per virtual pipeline stage) takes the
next micro-batch, the last stage turns the chunk's output into a loss or other data, and
megatron passes activations and their gradients between stages. Micro-batch size is 1 (a
micro-batch is one packed sequence); under PP>1 every micro-batch of a call has the same
length, given to the schedule as ``seq_length`` (``micro_batches.MicroBatcher.equalize``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_multilora.layers.lifecycle import ModelOrChunks, model_chunks
from megatron_multilora.models.loss_rows import selectable, token_loss_and_choices
from megatron_multilora.ops.host_values import on_device
from megatron_multilora.ops.slot_layout import SlotLayout
from megatron_multilora.training.objectives.objective import MAX_METRICS, Objective
from megatron_multilora.training.objectives.registry import DEFAULT
from megatron_multilora.training.step.cuda_graphs import ChunkGraphs
from megatron_multilora.training.step.micro_batches import MicroBatch, chunk_inputs

# loss_func(micro-batch, chunk output) -> what megatron's forward_step_calc_loss takes.
LossFunc = Callable[[MicroBatch, torch.Tensor], Any]


@contextlib.contextmanager
def eval_mode(chunks: list[torch.nn.Module]) -> Iterator[None]:
    """The chunks in eval mode (no dropout) for the block, then as they were."""
    modes = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    try:
        yield
    finally:
        for chunk, mode in zip(chunks, modes):
            chunk.train(mode)


def run_schedule(
    model: ModelOrChunks,
    micro_batches: Sequence[MicroBatch],
    loss_func: LossFunc,
    forward_only: bool,
    collect_non_loss_data: bool = False,
    choices: bool = False,
    graphs: ChunkGraphs | None = None,
    **forward_kwargs: Any,
) -> list[Any]:
    """Run the micro-batches through the schedule; returns what the last stage's
    ``loss_func`` reported per micro-batch (empty on the other stages).

    The chunk is called with :func:`.micro_batches.chunk_inputs` and the labels (unless
    ``forward_kwargs`` says ``labels=None``); ``loss_func(mb, output)`` returns megatron's ``(loss, num_tokens, data)`` or, with
    ``collect_non_loss_data``, the data alone. ``choices``: ``loss_func(mb, output,
    choices=...)`` is also given the loss rows' clear greedy choices
    (:func:`~megatron_multilora.models.loss_rows.token_loss_and_choices`; None where the model
    runs whole). Forward-only calls run without autograd. ``graphs``: the one chunk's
    forward and backward replayed from CUDA graphs (``cuda_graphs.ChunkGraphs``; each
    position's loss, the labels given).
    """
    chunks = model_chunks(model)
    if not micro_batches:
        return []
    device = next(chunks[0].parameters()).device
    # The loss's rows (found on the host: no device sync), where a chunk here projects onto
    # the vocabulary at chosen rows and the caller wants the loss, not logits.
    pick = graphs is None and "labels" not in forward_kwargs and any(selectable(c) for c in chunks)
    # An adapted output layer sees only those rows: its slots' counts among them.
    adapted = any(hasattr(getattr(c, "output_layer", None), "slot_layout") for c in chunks)
    rows = [loss_rows(mb) if pick else None for mb in micro_batches]
    rows = [
        (r.to(device), rows_layout(mb, r) if adapted else None) if pick else (None, None)
        for mb, r in zip(micro_batches, rows)
    ]
    static = [graphs.inputs(mb) if graphs else None for mb in micro_batches]  # from the host
    mbs = [mb.to(device) for mb in micro_batches]
    lengths = {mb.tokens.size(1) for mb in mbs}
    if parallel_state.get_pipeline_model_parallel_world_size() > 1 and len(lengths) > 1:
        raise ValueError(
            f"under pipeline parallelism every micro-batch of a call must have one "
            f"length (the p2p tensor shape), got {sorted(lengths)}"
        )

    def forward_step(
        data_iterator: Iterator[tuple[MicroBatch, torch.Tensor | None, tuple | None]],
        chunk: torch.nn.Module,
        *_,
    ):
        mb, (at, at_layout), inputs = next(data_iterator)
        # The packed params carry the micro-batch's slot layout to the adapted layers (also to
        # their recompute re-runs, which may run after later micro-batches' forwards).
        if inputs is not None:
            output, chosen = graphs(inputs), None
        elif at is None:
            output = chunk(**chunk_inputs(chunk, mb), **{"labels": mb.labels, **forward_kwargs})
            chosen = None
        else:
            output, chosen = token_loss_and_choices(
                chunk,
                {**chunk_inputs(chunk, mb), **forward_kwargs},
                mb.labels,
                at,
                choices,
                at_layout,
            )
        if output.requires_grad:
            # A filler's (pads only) aux-loss gradient is scaled to zero: it trains nothing.
            # Its backward runs whenever the schedule says; the hook fires as it starts, before
            # any layer's aux-loss backward, and every micro-batch sets its own scale.
            only_pads = mb.n_pad == mb.tokens.size(1)
            output.register_hook(partial(_set_aux_loss_scale, 0.0 if only_pads else 1.0))
        return output, partial(loss_func, mb, choices=chosen) if choices else partial(loss_func, mb)

    with (
        torch.no_grad() if forward_only else contextlib.nullcontext(),
        _aux_loss_scale_kept(device),
    ):
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            # One iterator per chunk, each over all the micro-batches: every virtual stage
            # runs every micro-batch.
            data_iterator=[iter(list(zip(mbs, rows, static))) for _ in chunks],
            model=chunks,
            num_microbatches=len(mbs),
            seq_length=max(lengths),
            micro_batch_size=1,
            forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data,
        )


def loss_rows(mb: MicroBatch) -> torch.Tensor:
    """The positions of ``mb`` with a loss (at least one: a filler's first pad)."""
    rows = mb.loss_mask[0].nonzero().flatten()
    return rows if rows.numel() else torch.zeros(1, dtype=torch.int64)


def rows_layout(mb: MicroBatch, rows: torch.Tensor) -> SlotLayout:
    """The slot layout of ``rows`` (ascending positions of ``mb``, on the host): how many of
    them fall in each slot's stretch of the packed micro-batch."""
    starts = list(itertools.accumulate(mb.counts, initial=0))
    ends = torch.tensor(starts[1:])
    taken = torch.searchsorted(rows, ends).tolist()  # rows before each slot's end
    return SlotLayout([b - a for a, b in itertools.pairwise([0, *taken])])


def _set_aux_loss_scale(scale: float, grad: torch.Tensor) -> None:
    # A fresh tensor (shape [1], as megatron's): set_loss_scale copies into the current one.
    MoEAuxLossAutoScaler.main_loss_backward_scale = on_device([scale], torch.float32, grad.device)


@contextlib.contextmanager
def _aux_loss_scale_kept(device: torch.device) -> Iterator[None]:
    """Put MoE's aux-loss backward scale back as it was after a schedule call."""
    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    # Our own tensor meanwhile: megatron copies 1 into the current one after every forward
    # (no grad_scale_func, calculate_per_token_loss), which must not overwrite ``saved``.
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.ones(1, device=device)
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved


def objective_loss(
    objectives: Sequence[Objective],
    weights: Sequence[float],
    mb: MicroBatch,
    token_loss: torch.Tensor,
    choices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The last stage's loss of one micro-batch: each slot's span goes to its objective
    (``objectives[s]``), whose loss and metric sums weigh ``weights[s]`` (1 / the slot's loss
    units; 0: the slot does not count). Returns megatron's ``(loss, num_tokens, data)`` with
    the per-slot table (float64 ``[n_slots, 1 + MAX_METRICS]``: loss, then the objective's
    metrics) and every position's target log-prob (0 where the mask is) as data, with the
    greedy ``choices`` (``[1, S]``) where given. Used with ``calculate_per_token_loss=True``, so megatron divides by
    neither the token count nor the number of micro-batches."""
    mask = mb.loss_mask[0]
    # where(): a token that does not count (padding, prompt) must not carry a non-finite
    # log-prob into its slot's sum.
    logprobs = torch.where(mask > 0, -token_loss[0].float(), torch.zeros((), device=mask.device))
    sequence = mb.sequence_ids()
    table = torch.zeros(len(mb.counts), 1 + MAX_METRICS, dtype=torch.float64, device=mask.device)
    # Zero, but on the graph: a micro-batch none of whose slots counts (a filler, or slots
    # another call trains) still runs its backward, and with it the collectives its peers'
    # backward waits on (MoE all-to-all under EP, the pipeline's gradient sends).
    total = logprobs.sum() * 0.0
    values = {k: v[0] for k, v in mb.values.items()}
    for kind, (slots, spans) in _spans_by_objective(objectives, weights, mb).items():
        losses, metrics = kind.spans_loss(
            [objectives[s] for s in slots], logprobs, mask, values, sequence, spans
        )
        weight = on_device([weights[s] for s in slots], torch.float64, mask.device)
        weighted = losses.double() * weight
        total = total + weighted.sum().to(total.dtype)
        rows = on_device(slots, torch.int64, mask.device)
        table[rows, 0] = weighted.detach()
        if metrics.size(1):
            table[rows, 1 : 1 + metrics.size(1)] = metrics.detach().double() * weight[:, None]
    data = {"per_slot": table, "logprobs": logprobs.detach()}
    if choices is not None:
        data["choices"] = choices[0]
    return total, mask.sum().to(torch.int), data


def _spans_by_objective(
    objectives: Sequence[Objective], weights: Sequence[float], mb: MicroBatch
) -> dict[type[Objective], tuple[list[int], list[tuple[int, int]]]]:
    """The slots that count in ``mb`` and their spans, by their objective's class."""
    out: dict[type[Objective], tuple[list[int], list[tuple[int, int]]]] = {}
    start = 0
    for slot, count in enumerate(mb.counts):
        start += count
        if not count or not weights[slot] or not mb.examples_per_slot[slot]:
            continue  # pads only (a filler's span carries no objective inputs)
        slots, spans = out.setdefault(type(objectives[slot]), ([], []))
        slots.append(slot)
        spans.append((start - count, start))
    return out


def per_slot_results(
    model: ModelOrChunks,
    micro_batches: Sequence[MicroBatch],
    denominators: torch.Tensor,
    forward_only: bool = False,
    objectives: Sequence[Objective | None] | None = None,
) -> torch.Tensor:
    """Forward (and backward) the micro-batches; returns each adapter's summed normalised
    loss and metrics over this rank's micro-batches (``[n_slots, 1 + MAX_METRICS]``, column
    0 the loss), on every pipeline stage (float64, on the CPU).

    Slot s's loss and metric sums weigh ``1 / denominators[s]`` (its loss units over the
    global batch; 0 where it has none), so summed over data-parallel ranks each adapter's
    values are means over its global batch. ``objectives[s]``: slot s's objective (default,
    and where None: the registry's DEFAULT).
    """
    return per_slot_results_and_data(
        model, micro_batches, denominators, forward_only, objectives, keep=()
    )[0]


KEPT_DTYPES = {"logprobs": torch.float32, "choices": torch.int64}
"""What :func:`per_slot_results_and_data` can keep per example, and its dtype."""


def per_slot_results_and_data(
    model: ModelOrChunks,
    micro_batches: Sequence[MicroBatch],
    denominators: torch.Tensor,
    forward_only: bool = False,
    objectives: Sequence[Objective | None] | None = None,
    keep: Sequence[str] = ("logprobs",),
    graphs: ChunkGraphs | None = None,
) -> tuple[torch.Tensor, dict[str, list[list[list]]]]:
    """:func:`per_slot_results`, and for each name in ``keep``, per slot, per example, the
    value at each of its positions, on every stage: ``"logprobs"``, each target's log-prob
    where its loss mask is set (0 elsewhere); ``"choices"``, the clear greedy choice after
    each prefix where the mask is set (-1 elsewhere, and everywhere where the model's output
    layer runs whole: :func:`~megatron_multilora.models.loss_rows.token_loss_and_choices`).
    ``graphs``: as :func:`run_schedule`'s."""
    chunks = model_chunks(model)
    if not chunks[0].config.calculate_per_token_loss:
        raise ValueError(
            "build the model with calculate_per_token_loss=True: the per-adapter "
            "losses are normalised here, megatron must not divide them again"
        )
    device = next(chunks[0].parameters()).device
    n = denominators.numel()
    weights = [1.0 / float(d) if d > 0 else 0.0 for d in denominators.tolist()]
    chosen = [DEFAULT() if o is None else o for o in (objectives or [None] * n)]
    store = run_schedule(
        chunks,
        micro_batches,
        partial(objective_loss, chosen, weights),
        forward_only=forward_only,
        choices="choices" in keep,
        graphs=graphs,
    )
    per_slot = torch.zeros(n, 1 + MAX_METRICS, dtype=torch.float64, device=device)
    for data in store:
        per_slot += data["per_slot"]
    kept = {}
    for name in keep:
        values = [
            data[name] if name in data else torch.full_like(data["logprobs"], -1, dtype=torch.int64)
            for data in store
        ]
        kept[name] = per_example(micro_batches, values, n, device, KEPT_DTYPES[name])
    return from_last_stage(per_slot).cpu(), kept  # read back once per call


def per_example(
    micro_batches: Sequence[MicroBatch],
    per_position: list[torch.Tensor],
    n_slots: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> list[list[list]]:
    """Per slot, per example (in packing order), its positions' values of ``per_position``
    (the last stage's ``[S]`` tensor of each micro-batch, as ``dtype``; empty on the other
    stages), on every stage."""
    out: list[list[list]] = [[] for _ in range(n_slots)]
    for i, mb in enumerate(micro_batches):
        values = per_position[i] if per_position else torch.zeros(mb.tokens.size(1), device=device)
        values = from_last_stage(values.to(dtype).contiguous()).cpu().tolist()
        position, sequence = 0, 0
        for slot, count in enumerate(mb.examples_per_slot):
            for _ in range(count):
                length = mb.seq_lengths[sequence]
                out[slot].append(values[position : position + length])
                position, sequence = position + length, sequence + 1
    return out


def per_slot_losses(
    model: ModelOrChunks,
    micro_batches: Sequence[MicroBatch],
    denominators: torch.Tensor,
    forward_only: bool = False,
) -> torch.Tensor:
    """Each adapter's loss column of :func:`per_slot_results` by the default objective (``[n_slots]``)."""
    return per_slot_results(model, micro_batches, denominators, forward_only)[:, 0].contiguous()


def from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the last pipeline stage holds it, on every stage (in place)."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            tensor,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    return tensor

"""A step's packed micro-batches through megatron's pipeline schedules, for every PP size.

``get_forward_backward_func()`` runs the forward and backward passes (PP=1 included, so one
code path serves every layout): each model chunk (one per virtual pipeline stage) takes the
next micro-batch, the last stage turns the chunk's output into a loss or other data, and
megatron passes activations and their gradients between stages. Micro-batch size is 1 (a
micro-batch is one packed sequence); under PP>1 every micro-batch of a call has the same
length, given to the schedule as ``seq_length`` (see ``step.prepare_micro_batches``).
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_multilora.data.packing import MicroBatch
from megatron_multilora.layers.lifecycle import ModelOrChunks

# loss_func(micro-batch, chunk output) -> what megatron's forward_step_calc_loss takes.
LossFunc = Callable[[MicroBatch, torch.Tensor], Any]


def model_chunks(model: ModelOrChunks) -> list[torch.nn.Module]:
    """The model as megatron's schedules take it: a list of chunks (one per virtual stage)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def micro_batch_multiple(model: ModelOrChunks) -> int:
    """What a call's micro-batch count must be a multiple of: with virtual pipeline stages
    the interleaved schedule runs micro-batches in groups of
    ``microbatch_group_size_per_vp_stage`` (megatron's default: the PP size); else 1."""
    chunks = model_chunks(model)
    return chunks[0].config.microbatch_group_size_per_vp_stage if len(chunks) > 1 else 1


def run_schedule(model: ModelOrChunks, micro_batches: Sequence[MicroBatch], loss_func: LossFunc,
                 forward_only: bool, collect_non_loss_data: bool = False,
                 **forward_kwargs: Any) -> list[Any]:
    """Run the micro-batches through the schedule; returns what the last stage's
    ``loss_func`` reported per micro-batch (empty on the other stages).

    The chunk is called with tokens, positions, labels (unless ``forward_kwargs`` says
    ``labels=None``), the micro-batch's ``PackedSeqParams`` and megatron's MoE padding
    mask; ``loss_func(mb, output)`` returns megatron's ``(loss, num_tokens, data)`` or, with
    ``collect_non_loss_data``, the data alone. Forward-only calls run without autograd.
    """
    chunks = model_chunks(model)
    if not micro_batches:
        return []
    device = next(chunks[0].parameters()).device
    mbs = [mb.to(device) for mb in micro_batches]
    lengths = {mb.tokens.size(1) for mb in mbs}
    if parallel_state.get_pipeline_model_parallel_world_size() > 1 and len(lengths) > 1:
        raise ValueError(f"under pipeline parallelism every micro-batch of a call must have one "
                         f"length (the p2p tensor shape), got {sorted(lengths)}")

    def forward_step(data_iterator: Iterator[MicroBatch], chunk: torch.nn.Module, *_):
        mb = next(data_iterator)
        only_pads = mb.n_pad == mb.tokens.size(1)
        kwargs = {"labels": mb.labels, **forward_kwargs}
        # Pads carry no loss, and megatron's padding mask keeps them out of MoE routers'
        # auxiliary losses, through which they would otherwise change adapters' gradients.
        # A micro-batch of pads only (a filler) cannot be masked (the aux loss would be 0/0).
        # The packed params carry the micro-batch's slot layout to the adapted layers (also to
        # their recompute re-runs, which may run after later micro-batches' forwards).
        output = chunk(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params(),
                       padding_mask=None if only_pads else _padding_mask(chunk, mb), **kwargs)
        if output.requires_grad:
            # ... so a filler's aux-loss gradient is scaled to zero instead: it trains nothing.
            # Its backward runs whenever the schedule says; the hook fires as it starts, before
            # any layer's aux-loss backward, and every micro-batch sets its own scale.
            output.register_hook(partial(_set_aux_loss_scale, 0.0 if only_pads else 1.0))
        return output, partial(loss_func, mb)

    with torch.no_grad() if forward_only else contextlib.nullcontext(), _aux_loss_scale_kept(device):
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            # One iterator per chunk, each over all the micro-batches: every virtual stage
            # runs every micro-batch.
            data_iterator=[iter(mbs) for _ in chunks],
            model=chunks, num_microbatches=len(mbs), seq_length=max(lengths),
            micro_batch_size=1, forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data)


def _padding_mask(chunk: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """The micro-batch's MoE padding mask as ``chunk`` takes it: megatron splits it over the
    sequence-parallel ranks only in a chunk that embeds (first stage); a later stage's
    hidden states are already this rank's sequence shard, so the mask must be too."""
    mask = mb.padding_mask()
    config = chunk.config
    if config.sequence_parallel and not chunk.pre_process:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        mask = mask.chunk(tp, dim=1)[parallel_state.get_tensor_model_parallel_rank()]
    return mask


def _set_aux_loss_scale(scale: float, grad: torch.Tensor) -> None:
    # A fresh tensor (shape [1], as megatron's): set_loss_scale copies into the current one.
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor([scale], device=grad.device)


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


def normalised_loss(weight_per_slot: torch.Tensor, mb: MicroBatch, token_loss: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The last stage's loss of one micro-batch: token t of slot s weighs
    ``loss_mask_t * weight_per_slot[s]``; returns megatron's ``(loss, num_tokens, data)`` with
    the per-slot sums (float64) as data. Used with ``calculate_per_token_loss=True``, so
    megatron divides by neither the token count nor the number of micro-batches."""
    slot_of_token = torch.repeat_interleave(
        torch.arange(len(mb.counts), device=token_loss.device),
        torch.tensor(mb.counts, device=token_loss.device), output_size=sum(mb.counts))
    weights = mb.loss_mask[0] * weight_per_slot[slot_of_token]
    # where(): a token that does not count (padding, prompt) must not carry a non-finite loss
    # into its slot's sum.
    contrib = torch.where(weights > 0, token_loss[0].float() * weights,
                          torch.zeros((), device=weights.device))
    per_slot = torch.zeros(len(mb.counts), dtype=torch.float64, device=weights.device)
    per_slot.index_add_(0, slot_of_token, contrib.detach().double())
    num_tokens = mb.loss_mask.sum().to(torch.int)
    return contrib.sum(), num_tokens, {"per_slot": per_slot}


def per_slot_losses(model: ModelOrChunks, micro_batches: Sequence[MicroBatch],
                    denominators: torch.Tensor, forward_only: bool = False) -> torch.Tensor:
    """Forward (and backward) the micro-batches; returns each adapter's summed normalised
    loss over this rank's micro-batches, on every pipeline stage (float64, on the CPU).

    Token t of slot s weighs ``loss_mask_t / denominators[s]`` (0 where a slot has no loss
    tokens), so summed over data-parallel ranks each adapter's value is its mean token loss.
    """
    chunks = model_chunks(model)
    if not chunks[0].config.calculate_per_token_loss:
        raise ValueError("build the model with calculate_per_token_loss=True: the per-adapter "
                         "losses are normalised here, megatron must not divide them again")
    device = next(chunks[0].parameters()).device
    weight_per_slot = torch.where(denominators > 0, 1.0 / denominators.clamp(min=1).double(),
                                  torch.zeros((), dtype=torch.float64)).float().to(device)
    store = run_schedule(chunks, micro_batches, partial(normalised_loss, weight_per_slot),
                         forward_only=forward_only)
    per_slot = torch.zeros(denominators.numel(), dtype=torch.float64, device=device)
    for data in store:
        per_slot += data["per_slot"]
    return from_last_stage(per_slot).cpu()  # read back once per call, not per micro-batch


def from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the last pipeline stage holds it, on every stage (in place)."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    return tensor

"""The output layer at the positions that have a loss only.

Megatron's GPTModel projects every position onto the vocabulary and takes the cross entropy
of each; a fine-tuning loss needs the positions of completion tokens only (about half of a
packed micro-batch of short prompts and answers, less with longer prompts). On a 135M model
with a 49k vocabulary the output layer is a fifth of the model's GEMM work, and its
log-softmax over the vocabulary is the largest elementwise pass. :func:`token_loss` gives the
same per-token loss with the projection and the cross entropy run at the loss rows only.

The rows are picked on the output layer's input (a forward pre-hook, on for the one call), so
megatron's own forward runs unchanged and the weights (tied to the embedding or not) are its
own. With sequence parallelism the output layer gathers its input itself, so there the model
runs whole; likewise with multi-token prediction, whose loss reads every position.

The same logits also give each row's greedy choice (:func:`token_loss_and_choices`): what
greedy generation would pick after the row's prefix, which decides most greedy generations of
a held-out table without decoding them (``training/report/tables.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_multilora.ops.slot_layout import SlotLayout

CLEAR_MARGINS = {torch.float32: 1e-2, torch.bfloat16: 1.0}
"""A row's greedy choice counts as clear where its logit beats the runner-up's by more than
this, by the precision the model computes in (:func:`compute_dtype`): far above the
difference between the same position's logits in a packed forward and in a cached decoding
step (float rounding: at most 1.2e-4 in fp32 over the main job's 474 reference positions;
bf16 rounds a logit of 16-32 to steps of 0.125), so a clear choice is the token generation
picks there too."""


def compute_dtype(chunk: torch.nn.Module) -> torch.dtype:
    """fp32 where every GEMM of ``chunk`` runs in fp32, else bf16 (bf16 or fp16 training, or
    the frozen base's GEMMs in bf16 on CPU: ``ops/packed_linear.py``)."""
    config = chunk.config
    reduced = (
        config.bf16
        or config.fp16
        or config.params_dtype not in (torch.float32, torch.float64)
        or any(
            getattr(m, "_frozen_gemm_dtype", torch.float32) != torch.float32
            for m in chunk.modules()
        )
    )
    return torch.bfloat16 if reduced else torch.float32


def selectable(chunk: torch.nn.Module) -> bool:
    """Whether ``chunk`` (a GPTModel, or a pipeline stage of one) can run its output layer at
    chosen rows: it has one, without sequence parallelism or multi-token prediction."""
    layer = getattr(chunk, "output_layer", None)
    base = getattr(layer, "to_wrap", layer)  # an adapted output layer: its base's settings
    return (
        getattr(chunk, "post_process", False)
        and layer is not None
        and not getattr(base, "sequence_parallel", False)
        and not getattr(chunk.config, "mtp_num_layers", None)
    )


def token_loss(
    chunk: torch.nn.Module, inputs: dict[str, Any], labels: torch.Tensor, rows: torch.Tensor | None
) -> torch.Tensor:
    """``chunk(**inputs, labels=labels)`` (the per-token loss ``[1, S]`` on the last stage,
    the hidden states elsewhere), computed at ``rows`` only (positions of the packed
    sequence, on the chunk's device; the loss is 0 at the others). ``rows=None`` or a chunk
    that is not :func:`selectable`: the whole model as megatron runs it."""
    return token_loss_and_choices(chunk, inputs, labels, rows, choose=False)[0]


def token_loss_and_choices(
    chunk: torch.nn.Module,
    inputs: dict[str, Any],
    labels: torch.Tensor,
    rows: torch.Tensor | None,
    choose: bool = True,
    rows_layout: SlotLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_loss`, and (``choose``) each row's clear greedy choice: ``[1, S]`` int64,
    the token of the highest logit where it leads by more than its :data:`CLEAR_MARGINS`,
    -1 where it does not and at the positions that are not rows. None where the model runs
    whole. ``rows_layout``: the adapter slots of ``rows``, for an adapted output layer."""
    if rows is None or not selectable(chunk):
        return chunk(**inputs, labels=labels), None
    with _output_rows(chunk.output_layer, rows, rows_layout):
        logits = chunk(**inputs, labels=None)  # [1, rows, vocab / TP]
    picked = chunk.compute_language_model_loss(labels[:, rows], logits.transpose(0, 1))
    where = (torch.zeros_like(rows), rows)
    loss = picked.new_zeros(labels.shape).index_put(where, picked[0])
    if not choose:
        return loss, None
    chosen = clear_choices(logits[0].detach(), CLEAR_MARGINS[compute_dtype(chunk)])
    choices = torch.full_like(labels, -1).index_put(where, chosen)
    return loss, choices


def clear_choices(logits: torch.Tensor, margin: float) -> torch.Tensor:
    """``[rows]``: each row's token of the highest logit of ``logits`` (``[rows, vocab / TP]``,
    this rank's vocabulary shard under TP), or -1 where it does not lead the runner-up by more
    than ``margin`` (a tie or near-tie: the choice may differ elsewhere)."""
    values, ids = logits.float().topk(2, dim=-1)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:  # the two best of every shard, then the two best of those
        ids = ids + parallel_state.get_tensor_model_parallel_rank() * logits.size(-1)
        group = parallel_state.get_tensor_model_parallel_group()
        every_values, every_ids = (
            [torch.empty_like(values) for _ in range(tp)],
            [torch.empty_like(ids) for _ in range(tp)],
        )
        dist.all_gather(every_values, values.contiguous(), group=group)
        dist.all_gather(every_ids, ids.contiguous(), group=group)
        values, best = torch.cat(every_values, -1).topk(2, dim=-1)
        ids = torch.cat(every_ids, -1).gather(-1, best)
    return torch.where(
        values[:, 0] - values[:, 1] > margin, ids[:, 0], torch.full_like(ids[:, 0], -1)
    )


@contextlib.contextmanager
def _output_rows(
    layer: torch.nn.Module, rows: torch.Tensor, layout: SlotLayout | None
) -> Iterator[None]:
    def pick(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = args[0] if args else kwargs.pop("input_")
        if layout is not None and hasattr(module, "slot_layout"):  # an adapted output layer
            module.slot_layout = layout
        return (hidden.index_select(0, rows), *args[1:]), kwargs  # [s, b, h]: rows of s

    handle = layer.register_forward_pre_hook(pick, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()

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
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch


def selectable(chunk: torch.nn.Module) -> bool:
    """Whether ``chunk`` (a GPTModel, or a pipeline stage of one) can run its output layer at
    chosen rows: it has one, without sequence parallelism or multi-token prediction."""
    layer = getattr(chunk, "output_layer", None)
    return (getattr(chunk, "post_process", False) and layer is not None
            and not getattr(layer, "sequence_parallel", False)
            and not getattr(chunk.config, "mtp_num_layers", None))


def token_loss(chunk: torch.nn.Module, inputs: dict[str, Any], labels: torch.Tensor,
               rows: Optional[torch.Tensor]) -> torch.Tensor:
    """``chunk(**inputs, labels=labels)`` (the per-token loss ``[1, S]`` on the last stage,
    the hidden states elsewhere), computed at ``rows`` only (positions of the packed
    sequence, on the chunk's device; the loss is 0 at the others). ``rows=None`` or a chunk
    that is not :func:`selectable`: the whole model as megatron runs it."""
    if rows is None or not selectable(chunk):
        return chunk(**inputs, labels=labels)
    with _output_rows(chunk.output_layer, rows):
        logits = chunk(**inputs, labels=None)  # [1, rows, vocab / TP]
    picked = chunk.compute_language_model_loss(labels[:, rows], logits.transpose(0, 1))
    return picked.new_zeros(labels.shape).index_put((torch.zeros_like(rows), rows), picked[0])


@contextlib.contextmanager
def _output_rows(layer: torch.nn.Module, rows: torch.Tensor) -> Iterator[None]:
    def pick(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = args[0] if args else kwargs.pop("input_")
        return (hidden.index_select(0, rows), *args[1:]), kwargs  # [s, b, h]: rows of s

    handle = layer.register_forward_pre_hook(pick, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()

"""Module paths that name the same linear under any pipeline layout.

Under pipeline parallelism each stage (or virtual stage) holds its decoder layers as
``decoder.layers.0..k-1``, while megatron's ``TransformerLayer.layer_number`` is global
(1-based, stage offset included). Adapter init seeds, adapter state-dict keys and slot
tensors name a linear by its global path, ``decoder.layers.<global index>...``, so they
agree between layouts. This is the one place that maps local paths to global ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer


def global_named_modules(
    chunk: torch.nn.Module, skip_inside: type | None = None
) -> Iterator[tuple[str, str, torch.nn.Module]]:
    """``(local name, global name, module)`` for every module of ``chunk``: inside a
    TransformerLayer the layer's local index is replaced by its global one. Modules inside
    one of type ``skip_inside`` are not visited (a multi-LoRA layer's slots: a walk then
    costs the same whatever the number of slots)."""
    local_layer, global_layer = None, None
    for name, module in _named_modules(chunk, skip_inside):  # pre-order: a layer first
        if isinstance(module, TransformerLayer):
            parent, index = name.rpartition(".")[0], str(module.layer_number - 1)
            local_layer, global_layer = name, f"{parent}.{index}" if parent else index
            yield name, global_layer, module
        elif local_layer is not None and name.startswith(local_layer + "."):
            yield name, global_layer + name[len(local_layer) :], module
        else:
            yield name, name, module


def _named_modules(
    root: torch.nn.Module, skip_inside: type | None
) -> Iterator[tuple[str, torch.nn.Module]]:
    """``root.named_modules()`` (pre-order, each module once) without descending into the
    modules of type ``skip_inside``."""
    seen: set[int] = set()
    stack = [("", root)]
    while stack:
        name, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield name, module
        if skip_inside is not None and isinstance(module, skip_inside):
            continue
        children = [(f"{name}.{k}" if name else k, c) for k, c in module._modules.items()]
        stack.extend((n, c) for n, c in reversed(children) if c is not None)


def chunk_prefixes(chunks: Sequence[torch.nn.Module]) -> list[str]:
    """Each chunk's path prefix: none for one model, or for the virtual pipeline stages of
    one model (megatron's ``vp_stage`` set; their global paths do not overlap); otherwise
    ``chunkK.`` (separate models, whose paths would collide)."""
    if len(chunks) == 1 or all(getattr(c, "vp_stage", None) is not None for c in chunks):
        return [""] * len(chunks)
    return [f"chunk{k}." for k in range(len(chunks))]

"""One slot's adapter as full, layout-independent tensors, and back into any layout.

:func:`get_slot_tensors` assembles every factor of slot ``idx`` from its tensor-parallel and
expert-parallel shards into the tensor a TP=1/EP=1 model would hold, cut to the slot's
rank; :func:`set_slot_tensors` does the inverse for the current layout (padding the rank
back to the layers' max rank), so callers need not know any shard layout (expert chunks,
gated fc1's per-rank ``[gate; up]``). Keys are ``<layer path>.adapter.linear_in.weight`` /
``...linear_out.weight``: A ``[r, in]`` and B ``[out, r]``, with a leading expert dim for
expert layers; layer paths are global (:mod:`.model_paths`). Under pipeline parallelism
both are collective over the pipeline group too and work on the whole model's dict: every
stage gets all stages' layers and loads its own. The same functions move optimizer state
shaped like the parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_multilora.layers.factors import FACTORS
from megatron_multilora.layers.lifecycle import (
    ModelOrChunks,
    multi_lora_modules,
    named_multi_lora_modules,
)
from megatron_multilora.layers.multi_lora_linear import MultiLoRALinear

ParamView = Callable[[torch.nn.Parameter], torch.Tensor]


def _factors(layer: MultiLoRALinear, idx: int):
    """(factor, key suffix, Parameter) of slot ``idx``'s factors in ``layer``."""
    return [(f, f"{f.child}.weight", f.weight(layer.adapters[idx])) for f in FACTORS]


def _pipeline_group() -> dist.ProcessGroup | None:
    """The pipeline group when there are several stages, else None."""
    if (
        not parallel_state.model_parallel_is_initialized()
        or parallel_state.get_pipeline_model_parallel_world_size() == 1
    ):
        return None
    return parallel_state.get_pipeline_model_parallel_group()


def _every_stage(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """``obj`` of every pipeline stage, in stage order (just ``[obj]`` without stages)."""
    if group is None:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def get_slot_tensors(
    model: ModelOrChunks, idx: int, value: ParamView | None = None
) -> dict[str, torch.Tensor]:
    """Slot ``idx``'s factors as full fp32 CPU tensors cut to its rank (``value(param)``
    instead of the parameter, e.g. a gradient or an optimizer moment), for the whole model
    (every pipeline stage's layers). Collective: every rank must call it."""
    multi_lora_modules(model)[0].adapters.check(idx)
    out = {}
    for path, layer in named_multi_lora_modules(model):
        rank = int(layer.adapters[idx].rank)
        for factor, name, param in _factors(layer, idx):
            local = (param if value is None else value(param)).detach().float()
            out[f"{path}.adapter.{name}"] = factor.cut(
                layer.tp_layout.gather(factor, local), rank
            ).cpu()
    return {k: v for stage in _every_stage(out, _pipeline_group()) for k, v in stage.items()}


def slot_rank_alpha(model: ModelOrChunks, idx: int) -> tuple[int, float]:
    """The slot's rank and alpha (the same in every layer)."""
    slot = multi_lora_modules(model)[0].adapters[idx]
    return int(slot.rank), float(slot.alpha)


def set_slot_tensors(
    model: ModelOrChunks,
    idx: int,
    tensors: dict[str, torch.Tensor],
    rank: int,
    alpha: float,
    dropout: float | None = None,
    *,
    into: ParamView | None = None,
) -> None:
    """Claim slot ``idx`` with ``rank``/``alpha`` (and ``dropout``; None keeps the slot's
    rate) and load full tensors (as from :func:`get_slot_tensors`) as this rank's shards.

    Keys must match the whole model's layers exactly (under pipeline parallelism: the
    union of every stage's; each stage loads its own) and shapes the layers cut to ``rank``
    (1..max rank); nothing changes unless everything fits, on any stage. Collective over
    the pipeline group when there are several stages. With ``into``, the tensors go into
    ``into(param)`` (e.g. optimizer state) and the slot itself is left alone.
    """
    layers = dict(named_multi_lora_modules(model))
    next(iter(layers.values())).adapters.check(idx)
    group = _pipeline_group()
    local_keys = {
        f"{p}.adapter.{n}" for p, layer in layers.items() for _, n, _ in _factors(layer, idx)
    }
    expected = set().union(*_every_stage(local_keys, group))  # the whole model's keys
    missing, unexpected = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected)
    if missing or unexpected:
        raise KeyError(
            f"adapter tensors do not match the model's layers: missing {missing[:3]} "
            f"({len(missing)}), unexpected {unexpected[:3]} ({len(unexpected)})"
        )
    max_rank = next(iter(layers.values())).max_rank
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise ValueError(f"rank={rank} is outside 1..{max_rank} (the layers' max rank)")
    shards, problem = {}, None
    for path, layer in layers.items():
        for factor, name, param in _factors(layer, idx):
            full = tensors[f"{path}.adapter.{name}"]
            padded = torch.zeros(layer.full_shape(factor), dtype=torch.float32)
            target = factor.cut(padded, rank)
            if target.shape != full.shape:
                problem = problem or (
                    f"{path}.adapter.{name}: shape {tuple(full.shape)} does "
                    f"not fit this model (expected {tuple(target.shape)})"
                )
                continue
            target.copy_(full)
            shards[param] = layer.tp_layout.shard(factor, padded)
    # A shape one stage refuses stops every stage: no stage loads alone.
    problems = [p for p in _every_stage(problem, group) if p is not None]
    if problems:
        raise ValueError(problems[0])
    if into is None:
        for layer in layers.values():
            layer.init_adapter_slot(idx, rank, alpha, dropout)
    with torch.no_grad():
        for param, shard in shards.items():
            dest = param if into is None else into(param)
            dest.copy_(shard.to(dest.dtype))
    if into is None:
        for layer in layers.values():
            layer.adapters.mask_rank(idx)

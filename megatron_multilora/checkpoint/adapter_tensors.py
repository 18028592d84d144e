"""One slot's adapter as full, layout-independent tensors, and back into any layout.

``gather_slot`` assembles every factor of slot ``idx`` from its tensor-parallel and
expert-parallel shards into the tensor a TP=1/EP=1 model would hold, cut to the slot's true
rank; ``load_slot`` does the inverse for the current layout (padding the rank back to the
layer's max rank). Keys are ``<layer path>.adapter.linear_in.weight`` /
``...linear_out.weight`` (A ``[r, in]`` / B ``[out, r]``, with a leading expert dim for
expert layers). The same functions move optimizer state shaped like the parameters.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_multilora.layers.expert_lora import MultiLoRAGroupedExpertLinear
from megatron_multilora.layers.lifecycle import ModelOrChunks, named_multi_lora_modules
from megatron_multilora.layers.multi_lora_linear import MultiLoRALinear
from megatron_multilora.ops.fused_rows import unshard_gate_up


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def gather_factor(layer: MultiLoRALinear, factor: str, local: torch.Tensor) -> torch.Tensor:
    """The full tensor of one factor ("A" or "B") from this rank's shard ``local``."""
    if isinstance(layer, MultiLoRAGroupedExpertLinear):
        group = parallel_state.get_expert_model_parallel_group()
        return torch.cat(_all_gather(local, group)) if dist.get_world_size(group) > 1 else local
    split = layer.sharding.a_split_dim if factor == "A" else layer.sharding.b_split_dim
    if split is None:
        return local
    parts = _all_gather(local, layer.sharding.group)
    if factor == "B" and layer.gated_output:
        return unshard_gate_up(parts)  # each rank holds [gate_r; up_r]
    return torch.cat(parts, dim=split)


def _factors(layer: MultiLoRALinear, idx: int):
    slot = layer.adapters[idx]
    return (("A", "linear_in.weight", slot.linear_in.weight),
            ("B", "linear_out.weight", slot.linear_out.weight))


def _cut(factor: str, t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[..., :rank, :] if factor == "A" else t[..., :rank]


def gather_slot(model: ModelOrChunks, idx: int,
                value: Optional[Callable[[torch.nn.Parameter], torch.Tensor]] = None
                ) -> dict[str, torch.Tensor]:
    """Slot ``idx``'s factors as full tensors cut to its rank (``value(param)`` instead of
    the parameter, e.g. an optimizer moment). Collective: every rank must call it."""
    out = {}
    for path, layer in named_multi_lora_modules(model):
        rank = int(layer.adapters[idx].rank)
        for factor, name, param in _factors(layer, idx):
            local = (param if value is None else value(param)).detach().float()
            out[f"{path}.adapter.{name}"] = _cut(factor, gather_factor(layer, factor, local), rank).cpu()
    return out


def slot_rank_alpha(model: ModelOrChunks, idx: int) -> tuple[int, float]:
    """The slot's rank and alpha (the same in every layer)."""
    layer = next(layer for _, layer in named_multi_lora_modules(model))
    slot = layer.adapters[idx]
    return int(slot.rank), float(slot.alpha)


def load_slot(model: ModelOrChunks, idx: int, tensors: dict[str, torch.Tensor], rank: int,
              alpha: float, into: Optional[Callable[[torch.nn.Parameter], torch.Tensor]] = None,
              dropout: Optional[float] = None) -> None:
    """Put full tensors (as from :func:`gather_slot`) into slot ``idx`` of this layout.

    Keys must match the model's layers exactly; ``rank`` must fit the layers' max rank.
    With ``into``, tensors go into ``into(param)`` (e.g. optimizer state) instead.
    """
    layers = dict(named_multi_lora_modules(model))
    expected = {f"{p}.adapter.{n}" for p, layer in layers.items() for _, n, _ in _factors(layer, idx)}
    missing, unexpected = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected)
    if missing or unexpected:
        raise KeyError(f"adapter tensors do not match the model's layers: missing {missing[:3]} "
                       f"({len(missing)}), unexpected {unexpected[:3]} ({len(unexpected)})")
    if into is None:
        for layer in layers.values():
            layer.init_adapter_slot(idx, rank, alpha, dropout)  # checks 1 <= rank <= dim
    with torch.no_grad():
        for path, layer in layers.items():
            for factor, name, param in _factors(layer, idx):
                full = tensors[f"{path}.adapter.{name}"]
                padded = torch.zeros(layer.full_shape(factor), dtype=torch.float32)
                target = _cut(factor, padded, rank)
                if target.shape != full.shape:
                    raise ValueError(f"{path}.adapter.{name}: shape {tuple(full.shape)} does not "
                                     f"fit this model (expected {tuple(target.shape)})")
                target.copy_(full)
                dest = param if into is None else into(param)
                dest.copy_(layer.local_shard(factor, padded).to(dest.dtype))
        if into is None:
            for layer in layers.values():
                layer._apply_rank_mask(idx)

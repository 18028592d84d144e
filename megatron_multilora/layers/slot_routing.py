"""Co-permute per-token slot ids through megatron's token dispatcher.

Inside the experts, rows are the dispatcher's expert-major permutation of tokens from every
expert-parallel rank. A forward pre-hook on each MoE layer's ``experts`` module runs after
dispatch and before the expert GEMMs, when the dispatcher's permutation metadata and the
final row order are both known. It replays that permutation on a vector holding each local
token's slot id:

* alltoall: permute 1 (``reversed_local_input_permutation_mapping``, every top-k copy takes
  its token's slot), the EP all-to-all with the dispatcher's splits, then the local-expert
  chunk sort when there are several local experts;
* allgather: the all-gather over the TP x EP group, then the local permute.

The result is sorted by key ``slot * E_local + expert`` (stable) into ``N * E_local`` groups
for the expert LoRA's grouped GEMMs. The companion exchange moves one int per dispatched row.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)

from megatron_multilora.layers.expert_lora import MultiLoRAGroupedExpertLinear
from megatron_multilora.layers.lifecycle import model_chunks
from megatron_multilora.ops.slot_layout import Segments, SlotLayout


@dataclasses.dataclass(frozen=True)
class ExpertSlotRouting:
    """Per-forward mapping from one MoE layer's dispatched rows to (slot, local expert).

    ``slots`` take part in the expert LoRA GEMMs, in this order; ``sort_idx`` orders rows by
    group ``position of slot in slots * E_local + expert``; ``inverse_idx`` restores the
    experts' order; ``segments`` are the ``len(slots) * E_local`` groups, each row labelled
    with its slot (for alpha/rank scaling); ``num_tokens`` guards against a base that pads
    its input.
    """

    slots: tuple[int, ...]
    sort_idx: torch.Tensor
    inverse_idx: torch.Tensor
    segments: Segments
    num_tokens: int


def local_slot_ids(tokens: SlotLayout, rows: int, device: torch.device) -> torch.Tensor:
    """Slot id of each token this rank feeds to the MoE layer (its SP window, or all)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if rows == tokens.total:
        start = 0
    elif rows * tp == tokens.total:
        start = parallel_state.get_tensor_model_parallel_rank() * rows
    else:
        raise ValueError(
            f"MoE layer input has {rows} tokens but tokens_per_adapter="
            f"{list(tokens.counts)} describes {tokens.total}; the counts must sum "
            "to the micro-batch's tokens (sequence x batch)"
        )
    return tokens.segments(start, rows, device).label_of_row


def co_permute_slot_ids(dispatcher: object, slot_ids: torch.Tensor) -> torch.Tensor:
    """Apply the dispatcher's token permutation (this forward's) to ``slot_ids``."""
    if isinstance(dispatcher, MoEAlltoAllTokenDispatcher):
        slot = slot_ids.index_select(0, dispatcher.reversed_local_input_permutation_mapping)
        if dispatcher.ep_size > 1:
            out_splits = [int(c) for c in dispatcher.output_splits]
            in_splits = [int(c) for c in dispatcher.input_splits]
            received = slot.new_empty(sum(out_splits))
            dist.all_to_all_single(received, slot, out_splits, in_splits, group=dispatcher.ep_group)
            slot = received
        if dispatcher.num_local_experts > 1:
            slot, _ = sort_chunks_by_idxs(
                slot,
                dispatcher.num_global_tokens_per_local_expert.ravel(),
                dispatcher.sort_input_by_local_experts,
            )
        return slot
    if isinstance(dispatcher, MoEAllGatherTokenDispatcher):
        group = dispatcher.tp_ep_group
        if dist.get_world_size(group) > 1:
            gathered = slot_ids.new_empty(slot_ids.numel() * dist.get_world_size(group))
            all_gather_flat(gathered, slot_ids.contiguous(), group)
            slot_ids = gathered
        return slot_ids.index_select(0, dispatcher.reversed_local_input_permutation_mapping)
    raise TypeError(f"no slot routing for {type(dispatcher).__name__}")


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Every rank's ``inp`` concatenated into ``out``, in rank order: ``all_gather_single`` in
    newer torch (2.13), which deprecates ``all_gather_into_tensor``, the only name older torch
    (2.6, 2.11) has."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def build_expert_slot_routing(
    slot: torch.Tensor,
    tokens_per_expert: torch.Tensor | list[int],
    slots: tuple[int, ...],
    n_slots: int,
    num_local_experts: int,
) -> ExpertSlotRouting:
    """Group the dispatched rows (slot ids ``slot``, expert-major) by (slot, local expert).

    Every row's slot must be in ``slots``. All on the device, with no device-to-host sync.
    """
    device, e = slot.device, num_local_experts
    counts = torch.as_tensor(tokens_per_expert, dtype=torch.int64).to(device)
    expert = torch.repeat_interleave(
        torch.arange(e, device=device), counts, output_size=slot.numel()
    )
    position = torch.zeros(n_slots, dtype=torch.int64)
    position[list(slots)] = torch.arange(len(slots))
    slot = slot.to(torch.int64)
    key = position.to(device)[slot] * e + expert
    sort_idx = torch.argsort(key, stable=True)
    inverse_idx = torch.empty_like(sort_idx)
    inverse_idx[sort_idx] = torch.arange(sort_idx.numel(), device=device)
    segments = Segments.from_sorted_keys(key[sort_idx], len(slots) * e, slot[sort_idx])
    return ExpertSlotRouting(tuple(slots), sort_idx, inverse_idx, segments, int(slot.numel()))


def _slot_routing_hook(layer: MoELayer, experts: list[MultiLoRAGroupedExpertLinear]):
    def hook(module: torch.nn.Module, args: tuple) -> None:
        dispatched, tokens_per_expert = args[0], args[1]
        tokens = experts[0].slot_layout
        if tokens is None:
            raise RuntimeError(
                f"{experts[0].full_name}: no token counts; pass packed_seq_params "
                "carrying them or call set_tokens_per_adapter_slot(model, counts) "
                "before forward"
            )
        dispatcher = layer.token_dispatcher
        rows = dispatcher.hidden_shape[:-1].numel()
        slot = co_permute_slot_ids(dispatcher, local_slot_ids(tokens, rows, dispatched.device))
        # Under expert parallelism rows also arrive from the other ranks' micro-batches: the
        # slots with tokens on any of them take part (see set_tokens_per_adapter_slot).
        slots = tokens.active if dispatcher.ep_size == 1 else tokens.ep_slots
        routing = build_expert_slot_routing(
            slot, tokens_per_expert, slots, experts[0].n_slots, experts[0].num_local_experts
        )
        for expert_linear in experts:
            expert_linear.routing = routing

    return hook


def check_moe_config(layer: MoELayer) -> None:
    """Reject MoE settings slot routing cannot follow, at construction and on every rank."""
    cfg, problems = layer.config, []
    if cfg.moe_token_dispatcher_type not in ("alltoall", "allgather"):
        problems.append(
            f"moe_token_dispatcher_type={cfg.moe_token_dispatcher_type!r} (use "
            "'alltoall' or 'allgather')"
        )
    if cfg.moe_expert_capacity_factor is not None or cfg.moe_pad_expert_input_to_capacity:
        problems.append(
            "token dropping / padding to capacity (moe_expert_capacity_factor, "
            "moe_pad_expert_input_to_capacity)"
        )
    if cfg.moe_permute_fusion:
        problems.append("moe_permute_fusion=True")
    if cfg.moe_router_padding_for_quantization:
        problems.append("moe_router_padding_for_quantization=True")
    if (cfg.expert_tensor_parallel_size or 1) > 1:
        problems.append(
            f"expert_tensor_parallel_size={cfg.expert_tensor_parallel_size} (must be 1)"
        )
    if cfg.moe_latent_size:
        problems.append("moe_latent_size (latent MoE projections)")
    if problems:
        raise ValueError("multi-LoRA on MoE experts does not support: " + "; ".join(problems))


def install_moe_slot_routing(model: torch.nn.Module | list[torch.nn.Module]) -> int:
    """Hook every MoE layer whose expert linears carry adapters and are not hooked yet;
    return how many were hooked by this call.

    Idempotent (a second call hooks nothing and returns 0), and a no-op on models without
    adapted experts.
    """
    hooked = 0
    for chunk in model_chunks(model):
        for layer in chunk.modules():
            if not isinstance(layer, MoELayer):
                continue
            experts = [
                m for m in layer.experts.children() if isinstance(m, MultiLoRAGroupedExpertLinear)
            ]
            if not experts or getattr(layer.experts, "_slot_routing_handle", None) is not None:
                continue
            check_moe_config(layer)
            layer.experts._slot_routing_handle = layer.experts.register_forward_pre_hook(
                _slot_routing_hook(layer, experts)
            )
            hooked += 1
    return hooked

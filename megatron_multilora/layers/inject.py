"""``apply_multi_lora``: freeze a Megatron model and wrap its target linears with slots."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

import torch
from megatron.core import parallel_state
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_multilora.deprecation import renamed_arguments
from megatron_multilora.layers.expert_lora import MultiLoRAGroupedExpertLinear
from megatron_multilora.layers.factors import B
from megatron_multilora.layers.fused_parts import Targets, kept_rows
from megatron_multilora.layers.lifecycle import ModelOrChunks, model_chunks
from megatron_multilora.layers.model_paths import global_named_modules
from megatron_multilora.layers.multi_lora_linear import MultiLoRALinear
from megatron_multilora.layers.sharding import base_kind
from megatron_multilora.layers.slot_layout_route import install_slot_layout_route
from megatron_multilora.layers.slot_routing import check_moe_config, install_moe_slot_routing
from megatron_multilora.parallel import collective_device
from megatron_multilora.validation import TARGETS


def _matches(name: str, target: str) -> bool:
    """A plain target matches the last path component; one with wildcards the whole path."""
    if any(c in target for c in "*?["):
        return fnmatch.fnmatchcase(name, target)
    return name.rsplit(".", 1)[-1] == target


def _wrappable(module: torch.nn.Module) -> bool:
    try:
        base_kind(module)
    except TypeError:
        return False
    return True


def set_adapter_trainability(model: ModelOrChunks) -> int:
    """Freeze everything but adapter slot parameters; return the trainable count."""
    trainable = 0
    for chunk in model_chunks(model):
        for p in chunk.parameters():
            p.requires_grad_(False)
        for m in chunk.modules():
            if isinstance(m, MultiLoRALinear):
                for p in m.adapters.parameters():
                    p.requires_grad_(True)
                    trainable += p.numel()
    return trainable


@renamed_arguments(n_adapters="n_slots", dim="max_rank")
def apply_multi_lora(
    model: ModelOrChunks,
    n_slots: int,
    max_rank: int,
    alpha: float,
    target_modules: Sequence[str] = TARGETS,
    column_init_method: str = "xavier",
    row_init_method: str = "zero",
    dropout: float = 0.0,
    dropout_position: str = "pre",
    seed: int | None = None,
    fully_sharded: bool = False,
) -> ModelOrChunks:
    """Wrap every target linear with a :class:`MultiLoRALinear` of ``n_slots`` slots of rank
    up to ``max_rank`` (formerly ``n_adapters`` and ``dim``: still accepted, deprecated).

    Grouped expert linears (``mlp.experts.linear_fc1/fc2``) get a
    :class:`MultiLoRAGroupedExpertLinear` and their MoE layers the slot-routing hook; shared
    experts and other dense linears a :class:`MultiLoRALinear`; routers are left alone.
    Transformer layers get the hooks that take each micro-batch's slot layout from its
    ``packed_seq_params`` (:mod:`.slot_layout_route`). Targets are module names (``"linear_qkv"``
    matches every ``...linear_qkv``), the names PEFT users write (``"q_proj"``: the q rows of
    every ``linear_qkv``; :mod:`.fused_parts`) or wildcard patterns over the full path
    (``"*.layers.0.*.linear_qkv"``), with global layer numbers under pipeline parallelism
    (:mod:`.model_paths`). ``seed`` (default: the first
    pipeline stage's torch seed, which stages may seed differently) and the global path seed
    each slot's initialisation, so it does not depend on the layout. The base is frozen;
    only adapter parameters stay trainable. ``fully_sharded`` selects the S-LoRA layout for
    TP-split dense linears (see :mod:`.sharding`; expert linears are not TP-split).
    Already-wrapped modules are left alone, so applying twice with the same settings changes
    nothing. Every check (settings, bases, MoE configuration) runs before the model is
    changed, so on error the model is left as it was. Returns ``model``.
    """
    if seed is None:
        seed = _first_stage_value(torch.initial_seed() % (2**31))
    settings = dict(
        n_slots=n_slots,
        max_rank=max_rank,
        alpha=alpha,
        seed=seed,
        column_init_method=column_init_method,
        row_init_method=row_init_method,
        dropout=dropout,
        dropout_position=dropout_position,
    )
    # Every wrapper is built and every check runs before the model is touched: an error
    # leaves it exactly as it was (not half-wrapped, its base not frozen).
    planned: list[tuple[torch.nn.Module, str, MultiLoRALinear]] = []  # (parent, child, wrapper)
    matched: set[str] = set()
    targets = Targets(target_modules)
    for chunk in model_chunks(model):
        planned += _plan(chunk, targets.names, settings, fully_sharded, matched)
    unmatched = _everywhere_unmatched(targets.unmatched(matched))
    if unmatched:
        raise ValueError(
            f"apply_multi_lora: target_modules {sorted(unmatched)} matched no "
            "linear of the model (misspelt, or a pattern for layers it lacks)"
        )
    adapted_experts = {
        id(parent) for parent, _, w in planned if isinstance(w, MultiLoRAGroupedExpertLinear)
    }
    for chunk in model_chunks(model):
        for layer in chunk.modules():
            if isinstance(layer, MoELayer) and id(layer.experts) in adapted_experts:
                check_moe_config(layer)
    for parent, child, wrapper in planned:
        setattr(parent, child, wrapper)
        parts = targets.parts.get(child)
        if parts is not None and (
            child in ("linear_qkv", "in_proj") or _is_gated_fc1(parent, child)
        ):
            rows = B.weight(wrapper.adapters[0]).size(-2)
            kept = kept_rows(child, parts, rows, wrapper.to_wrap.config)
            wrapper.adapt_only_rows(kept, parts)
    install_moe_slot_routing(model)
    install_slot_layout_route(model)
    for chunk in model_chunks(model):
        _keep_graph_through_recompute(chunk)
    set_adapter_trainability(model)
    return model


def _plan(
    chunk: torch.nn.Module,
    targets: Sequence[str],
    settings: dict,
    fully_sharded: bool,
    matched: set[str],
) -> list[tuple[torch.nn.Module, str, MultiLoRALinear]]:
    """The wrappers for ``chunk``'s target linears (checked, not installed); the targets
    that matched (an already-wrapped linear counts) are added to ``matched``."""
    planned = []
    config_sp = getattr(getattr(chunk, "config", None), "sequence_parallel", False)
    # Targets match, and wrappers are named by, global paths (the same under any pipeline
    # layout); the local name finds the module in this chunk.
    for local, name, module in global_named_modules(chunk):
        hits = [t for t in targets if name and _matches(name, t)]
        if isinstance(module, MultiLoRALinear):
            if (module.n_slots, module.max_rank) != (settings["n_slots"], settings["max_rank"]):
                raise ValueError(
                    f"{name} is already wrapped with n_slots={module.n_slots}, "
                    f"max_rank={module.max_rank}; asked for n_slots="
                    f"{settings['n_slots']}, max_rank={settings['max_rank']}"
                )
            matched.update(hits)
            continue
        ancestors = _ancestors(chunk, local)
        if not hits or any(isinstance(m, MultiLoRALinear) for m in ancestors):
            continue  # not a target, or the base inside a wrapper
        if any(isinstance(m, SequentialMLP) for m in ancestors):
            raise ValueError(
                f"{name} is an expert of a SequentialMLP (megatron's moe_grouped_gemm=False "
                "experts): multi-LoRA adapts grouped experts (TEGroupedMLP) only; build the "
                "model with moe_grouped_gemm=True, or leave the experts out of "
                "target_modules (e.g. '*.self_attention.*' patterns)"
            )
        parent_name, _, child = local.rpartition(".")
        parent = chunk.get_submodule(parent_name) if parent_name else chunk
        if isinstance(parent, TEGroupedMLP):
            local_experts = parent.num_local_experts
            wrapper: MultiLoRALinear = MultiLoRAGroupedExpertLinear(
                module,
                full_name=name,
                num_local_experts=local_experts,
                expert_offset=parallel_state.get_expert_model_parallel_rank() * local_experts,
                **settings,
            )
        elif _wrappable(module):
            wrapper = MultiLoRALinear(
                module,
                full_name=name,
                sequence_parallel=config_sp,
                gated_output=_is_gated_fc1(parent, child),
                fully_sharded=fully_sharded,
                **settings,
            )
        else:
            continue
        planned.append((parent, child, wrapper))
        matched.update(hits)
    return planned


def _everywhere_unmatched(unmatched: set[str]) -> set[str]:
    """The targets no pipeline stage matched (collective over the pipeline group)."""
    if (
        not parallel_state.model_parallel_is_initialized()
        or parallel_state.get_pipeline_model_parallel_world_size() == 1
    ):
        return unmatched
    stages: list = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    torch.distributed.all_gather_object(
        stages, unmatched, group=parallel_state.get_pipeline_model_parallel_group()
    )
    return set.intersection(*stages)


def _first_stage_value(value: int) -> int:
    """``value`` as the first pipeline stage has it (collective over the pipeline group)."""
    if (
        not parallel_state.model_parallel_is_initialized()
        or parallel_state.get_pipeline_model_parallel_world_size() == 1
    ):
        return value
    t = torch.tensor([value], device=collective_device())
    torch.distributed.broadcast(
        t,
        src=parallel_state.get_pipeline_model_parallel_first_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return int(t.item())


def _embedding_output_requires_grad(
    module: torch.nn.Module, args: tuple, output: torch.Tensor
) -> torch.Tensor:
    return output if output.requires_grad else output.requires_grad_()


def _keep_graph_through_recompute(chunk: torch.nn.Module) -> None:
    """With activation recompute, a checkpointed block whose inputs need no gradient (the
    frozen embedding's output) would cut the adapters inside it out of the graph; make the
    embedding output require grad, as PEFT does for checkpointed models."""
    config = getattr(chunk, "config", None)
    embedding = getattr(chunk, "embedding", None)
    if (
        getattr(config, "recompute_granularity", None)
        and embedding is not None
        and not getattr(embedding, "_requires_grad_hook", None)
    ):
        embedding._requires_grad_hook = embedding.register_forward_hook(
            _embedding_output_requires_grad
        )


def _is_gated_fc1(parent: torch.nn.Module, child: str) -> bool:
    """megatron's (expert) MLPs keep fc1's output as [gate; up] (per TP rank) when gated."""
    return (
        isinstance(parent, (MLP, TEGroupedMLP))
        and child == "linear_fc1"
        and bool(getattr(parent.config, "gated_linear_unit", False))
    )


def _ancestors(root: torch.nn.Module, name: str) -> list[torch.nn.Module]:
    parts = name.split(".")
    return [root.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]

"""Model-wide slot lifecycle: token routing, init/clear/load of a slot, expose and hide.

A model-wide adapter is slot ``idx`` of every multi-LoRA layer. These functions take a
model or a list of model chunks and act on every :class:`MultiLoRALinear` in it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Iterator, Sequence

import torch

from megatron_multilora.layers.factors import FACTORS
from megatron_multilora.layers.model_paths import chunk_prefixes, global_named_modules
from megatron_multilora.layers.multi_lora_linear import MultiLoRALinear
from megatron_multilora.ops.slot_layout import SlotLayout, check_ep_slots, check_token_counts

ModelOrChunks = torch.nn.Module | Sequence[torch.nn.Module]


def model_chunks(model: ModelOrChunks) -> list[torch.nn.Module]:
    """The model as a list of chunks (one per virtual pipeline stage; one without)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def named_multi_lora_modules(model: ModelOrChunks) -> Iterator[tuple[str, MultiLoRALinear]]:
    """(path, layer) for every multi-LoRA layer. Paths are global (``decoder.layers.<global
    index>...``, see :mod:`.model_paths`), so each names one linear of the whole model under
    any pipeline layout; separate models given as chunks get ``chunkK.``."""
    chunks = model_chunks(model)
    for prefix, chunk in zip(chunk_prefixes(chunks), chunks):
        for _, name, module in global_named_modules(chunk, skip_inside=MultiLoRALinear):
            if isinstance(module, MultiLoRALinear):
                yield prefix + name, module


def multi_lora_modules(model: ModelOrChunks) -> list[MultiLoRALinear]:
    layers = [m for _, m in named_multi_lora_modules(model)]
    if not layers:
        raise ValueError("the model has no multi-LoRA layers: call apply_multi_lora first")
    return layers


def num_adapter_slots(model: ModelOrChunks) -> int:
    """The number of slots N (the same in every layer)."""
    return multi_lora_modules(model)[0].n_slots


def set_tokens_per_adapter_slot(
    model: ModelOrChunks,
    tokens_per_adapter: torch.Tensor | Sequence[int],
    ep_slots: Sequence[int] | None = None,
) -> None:
    """Route the next packed micro-batch: slot i owns the next ``tokens_per_adapter[i]`` tokens.

    For calls whose ``packed_seq_params`` carry no layout. Under pipelining or activation
    recompute pass the layout with the micro-batch instead
    (:func:`.slot_layout_route.with_slot_layout`): set here, it is whatever was set last
    when a recompute re-runs a layer during backward.

    Tokens are the ``[s, b]`` positions flattened sequence-major; the counts must sum to
    ``s * b`` (checked in each layer's forward, naming the layer). Under expert parallelism
    a rank's experts also get rows of the other expert-parallel ranks' micro-batches:
    ``ep_slots`` are the slots with tokens on any of them (it must include this rank's, and
    no rank's rows may belong to a slot outside it), and only those take part in the expert
    GEMMs; without it every slot does. The training step agrees it in one collective
    (``training.step.micro_batches.align_with_expert_peers``).
    """
    layers = multi_lora_modules(model)
    counts = check_token_counts(tokens_per_adapter, layers[0].n_slots)
    check_ep_slots(ep_slots, counts)
    layout = SlotLayout(counts, ep_slots)
    for layer in layers:
        layer.slot_layout = layout


def slot_parameters(model: ModelOrChunks, idx: int) -> list[torch.nn.Parameter]:
    """Slot ``idx``'s trainable parameters across all layers (what its optimizer owns)."""
    layers = multi_lora_modules(model)
    layers[0].adapters.check(idx)
    return [p for layer in layers for p in layer.adapters[idx].parameters()]


def init_adapter_slot(
    model: ModelOrChunks, idx: int, rank: int, alpha: float, dropout: float | None = None
) -> None:
    """Claim slot ``idx`` in every layer with ``rank`` (1..max_rank), ``alpha`` and optionally its
    own LoRA dropout rate."""
    for layer in multi_lora_modules(model):
        layer.init_adapter_slot(idx, rank, alpha, dropout)


TARGET_PARTS = ("attn", "mlp", "unembed")


def target_part(path: str) -> str:
    """The part of the model an adapted linear is in, as a Tinker ``LoraConfig`` names them
    (``train_attn``, ``train_mlp``, ``train_unembed``): the output layer, an MLP's or
    experts' linears, or attention's."""
    if path.rsplit(".", 1)[-1] == "output_layer":
        return "unembed"
    return "mlp" if ".mlp." in f".{path}." else "attn"


def restrict_adapter_slot(model: ModelOrChunks, idx: int, parts: Collection[str]) -> None:
    """Slot ``idx`` adapts only the linears of ``parts`` (of :data:`TARGET_PARTS`): in the
    others both its factors are zeroed, which keeps them zero under any optimizer step (the
    gradient of each factor is a product with the other), so they add nothing and export
    leaves them out."""
    with torch.no_grad():
        for path, layer in named_multi_lora_modules(model):
            if target_part(path) not in parts:
                for factor in FACTORS:
                    factor.weight(layer.adapters[idx]).zero_()


def clear_adapter_slot(model: ModelOrChunks, idx: int, init_key: str | None = None) -> None:
    """Release slot ``idx`` in every layer: zero alpha, max rank, deterministic re-init
    (seeded by ``init_key`` when given, e.g. a job name, else by the slot index)."""
    for layer in multi_lora_modules(model):
        layer.clear_adapter_slot(idx, init_key)


@contextlib.contextmanager
def _swap_children(layers: Iterable[MultiLoRALinear], make) -> Iterator[None]:
    """Temporarily replace each layer's ``adapters`` child by ``make(layer)``'s children."""
    saved = []
    try:
        for layer in layers:
            replacement = make(layer)
            saved.append((layer, layer._modules.pop("adapters")))
            layer._modules.update(replacement)
        yield
    finally:
        for layer, adapters in saved:
            layer._modules.pop("adapter", None)
            layer._modules["adapters"] = adapters


@contextlib.contextmanager
def expose_adapter_slot(model: ModelOrChunks, idx: int) -> Iterator[None]:
    """Present slot ``idx`` of every layer as a single ``.adapter`` (slot index not in names).

    Inside, ``state_dict``/``named_parameters`` name the slot ``<layer>.adapter.*`` and no
    other slot, so what is saved from slot a loads into slot b. Restored on exit, also on
    an exception.
    """
    layers = multi_lora_modules(model)
    layers[0].adapters.check(idx)
    with _swap_children(layers, lambda layer: {"adapter": layer.adapters[idx]}):
        yield


@contextlib.contextmanager
def hide_adapters(model: ModelOrChunks) -> Iterator[None]:
    """Hide every adapter parameter, e.g. while a base checkpoint loads into the model."""
    with _swap_children(multi_lora_modules(model), lambda layer: {}):
        yield


@contextlib.contextmanager
def adapters_off(model: ModelOrChunks) -> Iterator[None]:
    """Every slot's LoRA term scaled by 0 inside: the model computes its base alone (the
    reference policy of DPO and of GRPO's KL), with the same micro-batches and layouts."""
    banks = [layer.adapters for layer in multi_lora_modules(model)]
    saved = [bank.scale.clone() for bank in banks]
    try:
        for bank in banks:
            bank.scale.zero_()
        yield
    finally:
        for bank, scale in zip(banks, saved):
            bank.scale.copy_(scale)


def adapter_state_dict(model: ModelOrChunks, idx: int) -> dict[str, torch.Tensor]:
    """Slot ``idx``'s tensors (this rank's shards) under slot-free names, ready to save.

    Keys are ``<layer path>.adapter.{linear_in.weight, linear_out.weight, rank, alpha,
    dropout}``,
    the names :func:`load_adapter` expects.
    """
    return {
        f"{path}.adapter.{k}": v.detach().clone()
        for path, layer in named_multi_lora_modules(model)
        for k, v in _slot_state(layer, idx).items()
    }


def _slot_state(layer: MultiLoRALinear, idx: int) -> dict[str, torch.Tensor]:
    layer.adapters.check(idx)
    return layer.adapters[idx].state_dict(keep_vars=True)


def load_adapter(model: ModelOrChunks, idx: int, state_dict: dict[str, torch.Tensor]) -> int:
    """Load an adapter saved by :func:`adapter_state_dict` (from any slot) into slot ``idx``.

    Tensors are this rank's shards, copied as they are. The key sets must match exactly
    (``KeyError`` naming missing and unexpected keys) and shapes must agree
    (``ValueError``); nothing is changed unless everything matches. Returns the number of
    tensors loaded.
    """
    targets = {
        f"{path}.adapter.{k}": v
        for path, layer in named_multi_lora_modules(model)
        for k, v in _slot_state(layer, idx).items()
    }
    if not targets:
        raise ValueError("the model has no multi-LoRA layers: call apply_multi_lora first")
    missing = sorted(targets.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - targets.keys())
    if missing or unexpected:
        raise KeyError(
            f"adapter state dict does not match the model's slot {idx}: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''} "
            f"({len(missing)}), unexpected {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''} ({len(unexpected)})"
        )
    bad = [
        (k, tuple(v.shape), tuple(state_dict[k].shape))
        for k, v in targets.items()
        if v.shape != state_dict[k].shape
    ]
    if bad:
        raise ValueError(f"adapter tensor shapes differ (key, model, given): {bad[:5]}")
    layers = dict(named_multi_lora_modules(model))
    bad_ranks = [
        (path, int(state_dict[f"{path}.adapter.rank"]))
        for path, layer in layers.items()
        if not 1 <= int(state_dict[f"{path}.adapter.rank"]) <= layer.max_rank
    ]
    if bad_ranks:
        raise ValueError(f"adapter ranks outside 1..max_rank (layer, rank): {bad_ranks[:5]}")
    with torch.no_grad():
        for k, v in targets.items():
            v.copy_(state_dict[k])
    for layer in layers.values():
        layer.adapters.mask_rank(idx)
        layer.adapters.refresh()
    return len(targets)

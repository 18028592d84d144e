"""``apply_multi_lora``: freeze a Megatron model and wrap its target linears with slots."""

from __future__ import annotations

import fnmatch
from typing import Optional, Sequence

import torch
from megatron.core.transformer.mlp import MLP

from megatron_multilora.layers.lifecycle import ModelOrChunks, _chunks
from megatron_multilora.layers.multi_lora_linear import MultiLoRALinear, base_kind

DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _matches(name: str, targets: Sequence[str]) -> bool:
    """A plain target matches the last path component; one with wildcards the whole path."""
    last = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, t) if any(c in t for c in "*?[") else last == t
               for t in targets)


def _wrappable(module: torch.nn.Module) -> bool:
    try:
        base_kind(module)
    except TypeError:
        return False
    return True


def set_adapter_trainability(model: ModelOrChunks) -> int:
    """Freeze everything but adapter slot parameters; return the trainable count."""
    trainable = 0
    for chunk in _chunks(model):
        for p in chunk.parameters():
            p.requires_grad_(False)
        for m in chunk.modules():
            if isinstance(m, MultiLoRALinear):
                for p in m.adapters.parameters():
                    p.requires_grad_(True)
                    trainable += p.numel()
    return trainable


def apply_multi_lora(
    model: ModelOrChunks,
    n_adapters: int,
    dim: int,
    alpha: float,
    target_modules: Sequence[str] = DEFAULT_TARGETS,
    column_init_method: str = "xavier",
    row_init_method: str = "zero",
    dropout: float = 0.0,
    dropout_position: str = "pre",
    seed: Optional[int] = None,
) -> ModelOrChunks:
    """Wrap every target linear with a :class:`MultiLoRALinear` of ``n_adapters`` slots.

    Targets are module names (``"linear_qkv"`` matches every ``...linear_qkv``) or
    wildcard patterns over the full path (``"*.layers.0.*.linear_qkv"``). The base is frozen;
    only adapter parameters stay trainable. Already-wrapped modules are left alone, so
    applying twice with the same settings changes nothing. Returns ``model``.
    """
    if seed is None:
        seed = torch.initial_seed() % (2**31)
    wrapped = 0
    for chunk in _chunks(model):
        config_sp = getattr(getattr(chunk, "config", None), "sequence_parallel", False)
        for name, module in list(chunk.named_modules()):
            if isinstance(module, MultiLoRALinear):
                if (module.n_adapters, module.dim) != (n_adapters, dim):
                    raise ValueError(f"{name} is already wrapped with n_adapters="
                                     f"{module.n_adapters}, dim={module.dim}; asked for "
                                     f"n_adapters={n_adapters}, dim={dim}")
                wrapped += 1
                continue
            if not name or not _matches(name, target_modules) or not _wrappable(module):
                continue
            if any(isinstance(m, MultiLoRALinear) for m in _ancestors(chunk, name)):
                continue  # the base inside a wrapper
            parent_name, _, child = name.rpartition(".")
            parent = chunk.get_submodule(parent_name) if parent_name else chunk
            setattr(parent, child, MultiLoRALinear(
                module, n_adapters, dim, alpha, name, column_init_method, row_init_method,
                dropout, dropout_position, sequence_parallel=config_sp,
                gated_output=_is_gated_fc1(parent, child), seed=seed))
            wrapped += 1
    if wrapped == 0:
        raise ValueError(f"apply_multi_lora: no linear matched target_modules={list(target_modules)}")
    set_adapter_trainability(model)
    return model


def _is_gated_fc1(parent: torch.nn.Module, child: str) -> bool:
    """megatron's MLP keeps fc1's output as [gate; up] per TP rank when it is gated."""
    return (isinstance(parent, MLP) and child == "linear_fc1"
            and bool(getattr(parent.config, "gated_linear_unit", False)))


def _ancestors(root: torch.nn.Module, name: str) -> list[torch.nn.Module]:
    parts = name.split(".")
    return [root.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]

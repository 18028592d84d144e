"""Layer specs: Transformer Engine where it runs, megatron's local spec elsewhere.

Without TE (or without CUDA) the local spec is used with its attention and norm swapped,
through the ModuleSpec, for the pure-torch modules in :mod:`.torch_modules`.
"""

from __future__ import annotations

import dataclasses

from typing import Optional

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_multilora.models.torch_modules import (
    AcrossHeadsRMSNorm,
    SDPAttention,
    TorchGroupedLinear,
    TorchNorm,
)


class TorchSpecProvider(LocalSpecProvider):
    """megatron's local backend with pure-torch attention, norms and grouped experts."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return TorchNorm

    def core_attention(self) -> type:
        return SDPAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
        # TEGroupedMLP with TE-interface torch grouped linears: same module paths as with TE.
        return TEGroupedMLP, MLPSubmodules(linear_fc1=TorchGroupedLinear,
                                           linear_fc2=TorchGroupedLinear)


def transformer_engine_usable() -> bool:
    """TE is importable and there is a GPU for it to run on."""
    return gpt_layer_specs.HAVE_TE and torch.cuda.is_available()


def gpt_block_spec(num_layers: int, qk_layernorm: bool = False,
                   num_experts: Optional[int] = None,
                   qk_layernorm_across_heads: bool = False,
                   ) -> TransformerBlockSubmodules | ModuleSpec:
    """The decoder-block spec for a GPT of ``num_layers`` layers (MoE MLPs with experts).

    ``qk_layernorm_across_heads`` swaps the per-head q/k norms for :class:`AcrossHeadsRMSNorm`
    (one RMSNorm over the whole q or k projection, as OLMoE has)."""
    if transformer_engine_usable():
        layer = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=num_experts is not None,
            qk_layernorm=qk_layernorm)
        return across_heads_qk_norm_spec(layer) if qk_layernorm_across_heads else layer
    layer = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=qk_layernorm)
    layer = torch_layer_spec(layer, qk_layernorm, num_experts)
    if qk_layernorm_across_heads:
        layer = across_heads_qk_norm_spec(layer)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=TorchNorm)


def across_heads_qk_norm_spec(layer: ModuleSpec) -> ModuleSpec:
    """``layer`` with its q/k norms replaced by RMSNorms over all heads of the projection."""
    attn = layer.submodules.self_attention
    attn_sub = dataclasses.replace(
        attn.submodules,
        q_layernorm=ModuleSpec(module=AcrossHeadsRMSNorm, params={"projection": "query"}),
        k_layernorm=ModuleSpec(module=AcrossHeadsRMSNorm, params={"projection": "key"}))
    return dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, self_attention=dataclasses.replace(attn, submodules=attn_sub)))


def torch_layer_spec(layer: ModuleSpec, qk_layernorm: bool,
                     num_experts: Optional[int] = None) -> ModuleSpec:
    """Swap the CUDA-only/non-SP submodules of a local layer spec for pure-torch ones."""
    attn = layer.submodules.self_attention
    attn_sub = dataclasses.replace(attn.submodules, core_attention=SDPAttention)
    if qk_layernorm:
        attn_sub = dataclasses.replace(attn_sub, q_layernorm=TorchNorm, k_layernorm=TorchNorm)
    layer_sub = dataclasses.replace(
        layer.submodules,
        input_layernorm=TorchNorm,
        pre_mlp_layernorm=TorchNorm,
        self_attention=dataclasses.replace(attn, submodules=attn_sub),
    )
    if num_experts is not None:
        layer_sub = dataclasses.replace(layer_sub, mlp=get_moe_module_spec_for_backend(
            TorchSpecProvider(), num_experts=num_experts, moe_grouped_gemm=True))
    return dataclasses.replace(layer, submodules=layer_sub)

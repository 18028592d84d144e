"""Layer specs: Transformer Engine where it runs, megatron's local spec elsewhere.

Without TE (or without CUDA) the local spec is used with its attention and norm swapped,
through the ModuleSpec, for the pure-torch modules in :mod:`.torch_modules`.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_multilora.models.torch_modules import SDPAttention, TorchNorm


def transformer_engine_usable() -> bool:
    """TE is importable and there is a GPU for it to run on."""
    return gpt_layer_specs.HAVE_TE and torch.cuda.is_available()


def gpt_block_spec(num_layers: int, qk_layernorm: bool = False) -> TransformerBlockSubmodules | ModuleSpec:
    """The decoder-block spec for a dense GPT of ``num_layers`` layers."""
    if transformer_engine_usable():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    layer = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=qk_layernorm)
    return TransformerBlockSubmodules(
        layer_specs=[torch_layer_spec(layer, qk_layernorm)] * num_layers, layer_norm=TorchNorm
    )


def torch_layer_spec(layer: ModuleSpec, qk_layernorm: bool) -> ModuleSpec:
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
    return dataclasses.replace(layer, submodules=layer_sub)

"""Megatron's multi-latent attention (MLA) submodules where TE is absent.

megatron's local spec builds MLA's q/kv down-projections column-parallel: their output is
gathered over TP and split into the kv latent and the RoPE key shared by all heads. Each
rank's heads then give that key only their part of its gradient, which the gather's
backward (a split) never sums over TP: input and adapter gradients come out wrong at TP > 1
(megatron-core 0.16.1; the forward is right). With replicated down-projections, megatron
takes the path TE's duplicated linears take, which under sequence parallelism gathers the
RoPE key over the sequence and so sums its gradient in the backward's reduce-scatter.
Without sequence parallelism that path leaves the same gradient partial, so MLA at TP > 1
needs sequence parallelism (:func:`.mla_config.mla_layout_problems`).
"""

from __future__ import annotations

import dataclasses

from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules

from megatron_multilora.models.torch_modules import TorchNorm


def mla_cpu_submodules(
    attn: MLASelfAttentionSubmodules, qk_layernorm: bool
) -> MLASelfAttentionSubmodules:
    """``attn`` with replicated q/kv down-projections (megatron's torch ``Linear``, which
    its MLA accepts in place of TE's duplicated ``TELinear``) and, with ``qk_layernorm``,
    torch RMSNorms over the q and kv latents."""
    attn = dataclasses.replace(
        attn, linear_q_down_proj=ReplicatedLinear, linear_kv_down_proj=ReplicatedLinear
    )
    if qk_layernorm:
        attn = dataclasses.replace(attn, q_layernorm=TorchNorm, kv_layernorm=TorchNorm)
    return attn

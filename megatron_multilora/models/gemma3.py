"""Gemma 3's departures from a Llama-style layer, injected into megatron's GPT through its
layer spec and one hook, without forking ``TransformerLayer``'s forward.

==========================  ================================================================
Gemma 3                     here
==========================  ================================================================
(1 + w) RMSNorm weights     folded into the weights at import (hf_import, families/gemma3_text)
post-attention / post-MLP   :class:`PostNormBiasDropoutAdd` in the ``self_attn_bda`` /
norms                       ``mlp_bda`` slots: the norm sees the branch output after
                            linear_proj / linear_fc2, multi-LoRA deltas included
sqrt(hidden) embedding      :func:`scale_input_embeddings`: a forward hook on the first stage's
scale                       embedding (tied to the output layer, so not foldable)
local / global RoPE bases   :class:`LayerTypeRopeAttention`: a sliding layer's angles are the
                            global table times a per-channel ratio
query_pre_attn_scalar       TransformerConfig.softmax_scale (models/gpt.py)
gelu-tanh gating            GPTModelConfig.activation = "gelu_tanh" (models/gpt.py)
==========================  ================================================================
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_multilora.models.gpt_config import GPTModelConfig
from megatron_multilora.models.torch_modules import TorchNorm

SLIDING = "sliding_attention"  # GPTModelConfig.layer_types' name of the local-RoPE layers


class PostNormBiasDropoutAdd(torch.nn.Module):
    """megatron's bias-dropout-add slot with a norm of the branch output before the residual
    add: ``residual + dropout(norm(out))``. Per token, so the same under sequence parallelism
    (the norm's weight is tagged like the other norms'). The branch has no bias
    (``add_bias_linear=False``)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if config.add_bias_linear:
            raise ValueError("PostNormBiasDropoutAdd: linear biases (add_bias_linear) unsupported")
        self.norm = TorchNorm(config, config.hidden_size, config.layernorm_epsilon)

    def forward(self, training: bool, fused: bool) -> Callable:
        """The bias-dropout-add function ``(out, bias), residual, prob -> tensor``, as
        ``get_bias_dropout_add(training, fused)`` returns it (TransformerLayer's call)."""
        add = get_bias_dropout_add(training, fused)

        def norm_then_add(
            out_with_bias: tuple[torch.Tensor, None], residual: torch.Tensor, prob: float
        ) -> torch.Tensor:
            out, bias = out_with_bias
            return add((self.norm(out), bias), residual, prob)

        return norm_then_add


@functools.lru_cache(maxsize=8)
def _rope_ratio(global_base: float, local_base: float, factor: float, dim: int) -> torch.Tensor:
    """``[dim]``: local angle / global angle per channel. The global table holds
    ``(p / factor) * inv_freq(global_base)`` (megatron's RotaryEmbedding), a sliding layer
    wants ``p * inv_freq(local_base)``; one tensor per setting, shared by every layer (the
    tables derived from it are cached by its identity)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    inv_global = 1.0 / (global_base**exponents)  # as megatron and transformers compute them
    inv_local = 1.0 / (local_base**exponents)
    ratio = (inv_local.double() / inv_global.double() * factor).float()
    return torch.cat((ratio, ratio))  # megatron's table repeats the angles: [f, f]


class LayerTypeRopeAttention(SelfAttention):
    """megatron's SelfAttention whose layer rotates with the local RoPE base when it is a
    sliding-attention layer (``layer_number - 1`` in ``local_layers``).

    Under RoPE a table is positions x inverse frequencies, so the local table is the global
    one (``rotary_pos_emb`` ``[s, 1, 1, dim]``, shared by all layers) times a per-channel
    ratio; it is computed once per global table and kept on it, so every sliding layer of a
    micro-batch passes the same tensor (ops/rope.py caches cos/sin per table object).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        *,
        local_layers: frozenset[int],
        rope_bases: tuple[float, float, float],
    ) -> None:
        super().__init__(
            config, submodules, layer_number, attn_mask_type, cp_comm_type, pg_collection
        )
        self.rope_bases = rope_bases if layer_number - 1 in local_layers else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        rotary_pos_emb: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.rope_bases is not None and rotary_pos_emb is not None:
            rotary_pos_emb = self._local_table(rotary_pos_emb)
        elif self.rope_bases is not None and kwargs.get("rotary_pos_cos") is not None:
            raise ValueError("per-layer RoPE bases need rotary_pos_emb (no flash decoding)")
        return super().forward(
            hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs
        )

    def _local_table(self, freqs: torch.Tensor) -> torch.Tensor:
        ratio = _rope_ratio(*self.rope_bases, freqs.size(-1))
        cached = getattr(freqs, "_local_rope", None)
        if cached is not None and cached[0] is ratio:
            return cached[1]
        table = freqs * ratio.to(freqs.device)
        freqs._local_rope = (ratio, table)
        return table


def gemma3_block_spec(
    block: TransformerBlockSubmodules, config: TransformerConfig, cfg: GPTModelConfig
) -> TransformerBlockSubmodules:
    """``block`` with the post norms in the bias-dropout-add slots (``cfg.post_norms``) and
    per-layer-type RoPE attention (``cfg.local_rotary_base``); unchanged without either."""
    if not (cfg.post_norms or cfg.local_rotary_base):
        return block
    post_norm = ModuleSpec(module=PostNormBiasDropoutAdd, params={"config": config})
    rope = cfg.local_rotary_base and {
        "local_layers": frozenset(i for i, t in enumerate(cfg.layer_types) if t == SLIDING),
        "rope_bases": (
            float(cfg.rotary_base),
            float(cfg.local_rotary_base),
            cfg.seq_len_interpolation_factor or 1.0,
        ),
    }

    def gemma_layer(layer: ModuleSpec) -> ModuleSpec:
        sub = layer.submodules
        if cfg.post_norms:
            sub = dataclasses.replace(sub, self_attn_bda=post_norm, mlp_bda=post_norm)
        if rope:
            attn = sub.self_attention
            attn = dataclasses.replace(
                attn, module=LayerTypeRopeAttention, params={**attn.params, **rope}
            )
            sub = dataclasses.replace(sub, self_attention=attn)
        return dataclasses.replace(layer, submodules=sub)

    return dataclasses.replace(block, layer_specs=[gemma_layer(s) for s in block.layer_specs])


def scale_input_embeddings(chunk: GPTModel, cfg: GPTModelConfig) -> None:
    """With ``cfg.scale_embeddings``, multiply the first stage's embedding output by
    sqrt(hidden_size) rounded to the weight dtype, as transformers' Gemma does (a scale
    commutes with the sequence-parallel scatter and the dropout inside the embedding)."""
    if not (cfg.scale_embeddings and chunk.pre_process):
        return
    dtype = chunk.embedding.word_embeddings.weight.dtype
    scale = torch.tensor(cfg.hidden_size**0.5).to(dtype)  # via fp32, as transformers rounds it

    def scaled(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out * scale.to(out.device)

    chunk.embedding.register_forward_hook(scaled)

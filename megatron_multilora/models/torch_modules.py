"""Pure-torch submodules swapped into megatron's local layer spec where TE is absent.

They keep the constructor and forward contracts of the megatron modules they replace, so
the rest of the layer (and checkpoint keys) is unchanged.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPAttention(MegatronModule):
    """Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

    Replaces megatron's ``DotProductAttention``, which allocates its score buffer on the
    CUDA device. Inputs are ``[s, b, heads, head_dim]`` (key/value with query-group heads,
    repeated for GQA); the output is ``[s, b, heads * head_dim]`` for this TP rank. A given
    mask is megatron's: bool, True = masked out.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention supports neither packed_seq_params nor attention_bias")
        mask_type = attn_mask_type or self.attn_mask_type
        groups = query.size(2) // key.size(2)
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        keep = None if attention_mask is None else ~attention_mask
        causal = keep is None and mask_type == AttnMaskType.causal
        dropout_p = self.dropout_p if self.training else 0.0
        # Heads are TP-sharded, so dropout draws from the tensor-parallel stream.
        with tensor_parallel.get_cuda_rng_tracker().fork():
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=keep, dropout_p=dropout_p, is_causal=causal,
                scale=self.softmax_scale,
            )
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class TorchNorm:
    """``torch.nn.LayerNorm`` / ``RMSNorm`` built from a megatron config, SP-aware.

    megatron's ``WrappedTorchNorm`` refuses sequence parallelism; under SP each rank's norm
    weights see only its sequence shard, so they are tagged ``sequence_parallel`` and
    megatron's gradient finalisation sums their gradients across TP ranks.
    """

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        **_: Any,
    ) -> torch.nn.Module:
        if config.normalization == "LayerNorm":
            norm: torch.nn.Module = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization {config.normalization!r}: use LayerNorm or RMSNorm")
        norm.to(config.params_dtype)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm

"""Gated DeltaNet: the linear-attention layers of Qwen3.5, in place of self-attention.

megatron-core 0.16's ``ssm/gated_delta_net.GatedDeltaNet`` needs flash-linear-attention's
GPU kernels and refuses packed sequences and inference; this module keeps its submodules
(:class:`GatedDeltaNetSubmodules`: ``in_proj``, ``out_norm``, ``out_proj``), its parameter
names and its fields (``linear_*`` of the TransformerConfig), and computes, in plain torch:

* one fused input linear, column-parallel over key heads (rows:
  :class:`~megatron_multilora.ops.fused_rows.DeltaNetRows`): q, k, v, the output gate z, and
  per value head b (``beta = sigmoid(b)``) and a (``g = -exp(A_log) softplus(a + dt_bias)``);
* a causal depthwise convolution over q, k, v (``linear_conv_kernel_dim`` taps, SiLU);
* the gated delta rule (:mod:`~megatron_multilora.ops.gated_delta_rule`), every key head
  shared by ``value heads / key heads`` value heads;
* an RMSNorm per value head gated by ``silu(z)``, and the row-parallel output linear.

Packed (thd) micro-batches run as batches of sequences of one padded length (the buckets
attention uses), each sequence from a zero state; the activations of its few values per head
run on rows padded to whole vector blocks (:mod:`~megatron_multilora.ops.lanes`): a
sequence's bits do not depend on its neighbours. Under megatron's static inference context (the KV-cache generation) a
layer keeps its convolution's last inputs and its delta-rule state per sequence in the
context's ``key_value_memory_dict`` (batch on dim 1, as the KV caches, so ``keep_rows``
drops finished rows of both).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_multilora.models.torch_modules import packed_layout
from megatron_multilora.ops.fused_rows import DeltaNetRows
from megatron_multilora.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from megatron_multilora.ops.lanes import lane_aligned

__all__ = ["GatedDeltaNet", "GatedDeltaNetSubmodules", "GatedRMSNorm"]


class GatedRMSNorm(torch.nn.Module):
    """``rms_norm(x) * weight * silu(gate)`` over each value head (Hugging Face's
    ``Qwen3_5RMSNormGated``: normalised in fp32, weighted in the input's dtype)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(dtype)
        return (out * lane_aligned(F.silu, gate.float())).to(dtype)


class GatedDeltaNet(MegatronModule):
    """One Gated DeltaNet layer: ``[s, b, hidden]`` (or packed ``[t, 1, hidden]``) in, the
    output and its bias (None) out, as megatron's attention modules."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: GatedDeltaNetSubmodules,
        layer_number: int,
        pg_collection: Any = None,
        **_: Any,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("Gated DeltaNet layers do not support context parallelism")
        self.layer_number = layer_number
        self.rows = DeltaNetRows.of(config)
        tp = config.tensor_model_parallel_size
        if self.rows.key_heads % tp or self.rows.value_heads % self.rows.key_heads:
            raise ValueError(
                f"Gated DeltaNet: {self.rows.key_heads} key heads must split into tensor "
                f"parallel size {tp} and divide the {self.rows.value_heads} value heads"
            )
        self.key_heads = self.rows.key_heads // tp  # this rank's
        self.value_heads = self.rows.value_heads // tp
        self.kernel = config.linear_conv_kernel_dim
        group = None if pg_collection is None else pg_collection.tp
        self.in_proj = build_module(
            submodules.in_proj,
            config.hidden_size,
            self.rows.key_heads * sum(self.rows.head_sizes()),
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="fc1",
            tp_group=group,
        )
        # Full tensors drawn, this rank's part kept: the same values on every TP layout.
        qk, v = self.rows.key_heads * self.rows.key_dim, self.rows.value_heads * self.rows.value_dim
        conv = torch.empty(2 * qk + v, 1, self.kernel)
        torch.nn.init.kaiming_uniform_(conv, a=5**0.5)  # torch's Conv1d default
        self.conv1d = torch.nn.utils.skip_init(  # no draws of its own: the layout's size
            torch.nn.Conv1d,
            self.channels,
            self.channels,
            self.kernel,
            groups=self.channels,
            bias=False,
        )
        rank = 0 if group is None else group.rank()
        self.conv1d.weight.data.copy_(
            torch.cat([conv[span] for span in self.rows.channel_spans(rank, tp)])
        )
        heads = slice(rank * self.value_heads, (rank + 1) * self.value_heads)
        self.dt_bias = torch.nn.Parameter(torch.ones(self.rows.value_heads)[heads].clone())
        a = torch.empty(self.rows.value_heads).uniform_(1, 16)
        self.A_log = torch.nn.Parameter(a.log()[heads].clone())
        for p in (self.conv1d.weight, self.dt_bias, self.A_log):
            p.data = p.data.to(config.params_dtype)
            set_tensor_model_parallel_attributes(p, True, 0, 1)
        self.out_norm = build_module(
            submodules.out_norm,
            config=config,
            hidden_size=self.rows.value_dim,
            eps=config.layernorm_epsilon,
        )
        self.out_proj = build_module(
            submodules.out_proj,
            self.rows.value_heads * self.rows.value_dim,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="fc2",
            tp_group=group,
        )

    @property
    def channels(self) -> int:
        """This rank's convolution channels: its q, k and v."""
        rows = self.rows
        return self.key_heads * 2 * rows.key_dim + self.value_heads * rows.value_dim

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        inference_context: Any = None,
        packed_seq_params: PackedSeqParams | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, None]:
        if attention_mask is not None:
            raise ValueError("Gated DeltaNet layers run causally, without an attention mask")
        fused, _ = self.in_proj(hidden_states)  # [s, b, rows]; sequence-gathered under SP
        s, b = fused.shape[:2]
        rows = self.rows
        q, k, v, z, beta, a = fused.view(s, b, self.key_heads, -1).split(rows.head_sizes(), -1)
        qkv = torch.cat([t.reshape(s, b, -1) for t in (q, k, v)], dim=-1)
        a = a.reshape(s, b, -1).float() + self.dt_bias
        g = -self.A_log.float().exp() * lane_aligned(F.softplus, a)
        beta = lane_aligned(torch.sigmoid, beta.reshape(s, b, -1))
        if packed_seq_params is not None:
            out = self._packed(qkv, g, beta, packed_seq_params)
        elif inference_context is not None:
            out = self._cached(qkv, g, beta, inference_context)
        else:  # b whole sequences
            out, _ = self._sequences(*(t.transpose(0, 1) for t in (qkv, g, beta)))
            out = out.transpose(0, 1)
        heads = (s, b, self.value_heads, self.rows.value_dim)
        out = self.out_norm(out.reshape(heads), z.reshape(heads))
        return self.out_proj(out.reshape(s, b, -1))

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[n, L, channels]`` -> q, k per key head repeated for its value heads, v."""
        rows, (n, length) = self.rows, qkv.shape[:2]
        qk = self.key_heads * rows.key_dim
        q, k, v = qkv.split([qk, qk, self.value_heads * rows.value_dim], dim=-1)
        q, k = (
            t.reshape(n, length, self.key_heads, rows.key_dim).repeat_interleave(rows.ratio, 2)
            for t in (q, k)
        )
        return q, k, v.reshape(n, length, self.value_heads, rows.value_dim)

    def _convolve(self, qkv: torch.Tensor, past: torch.Tensor | None = None) -> torch.Tensor:
        """Causal depthwise convolution of ``[n, L, channels]`` after ``past`` inputs
        (``[n, kernel - 1, channels]``; None: zeros, a sequence's start), SiLU."""
        length = qkv.size(1)
        if past is None:
            past = qkv.new_zeros(qkv.size(0), self.kernel - 1, qkv.size(2))
        x = torch.cat([past.to(qkv.dtype), qkv], dim=1).transpose(1, 2)
        return lane_aligned(F.silu, self.conv1d(x)[..., -length:].transpose(1, 2))

    def _sequences(
        self,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        past: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, L, ...]`` sequences (after ``past`` conv inputs and ``state``): their
        outputs ``[n, L, value heads, value_dim]`` and final states."""
        q, k, v = self._split(self._convolve(qkv, past))
        if state is not None and qkv.size(1) == 1:  # a decode step
            return recurrent_gated_delta_rule(q, k, v, g, beta, state)
        return chunk_gated_delta_rule(q, k, v, g, beta, state)

    def _packed(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, params: PackedSeqParams
    ) -> torch.Tensor:
        """``[t, 1, ...]`` packed sequences, each from a zero state."""
        if getattr(params, "one_pass", False) and qkv.is_cuda:
            raise ValueError("Gated DeltaNet layers cannot run in a CUDA-graphed chunk")
        layout = packed_layout(params, qkv.device)
        qkv, g, beta = (t[:, 0] for t in (qkv, g, beta))
        outs = [self._sequences(qkv[idx], g[idx], beta[idx])[0] for idx in layout.buckets]
        out = torch.cat([o.flatten(0, 1) for o in outs]).index_select(0, layout.unpack)
        return out.unsqueeze(1)

    def _cached(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, context: Any
    ) -> torch.Tensor:
        """Megatron's static batching: prefill (offset 0) starts each row's states, a
        decode step continues them."""
        rows = slice(context.batch_size_offset, context.batch_size_offset + qkv.size(1))
        qkv, g, beta = (t.transpose(0, 1) for t in (qkv, g, beta))  # [b, s, ...]
        memory = context.key_value_memory_dict
        if context.sequence_len_offset == 0:
            if self.layer_number not in memory:
                n = context.max_batch_size
                memory[self.layer_number] = (
                    qkv.new_zeros(self.kernel - 1, n, qkv.size(2)),
                    qkv.new_zeros(
                        self.value_heads, n, self.rows.key_dim, self.rows.value_dim
                    ).float(),
                )
            past, state = None, None
        else:
            conv, rec = memory[self.layer_number]
            past, state = conv[:, rows].transpose(0, 1), rec[:, rows].transpose(0, 1)
        out, state = self._sequences(qkv, g, beta, past, state)
        conv, rec = memory[self.layer_number]
        inputs = qkv if past is None else torch.cat([past.to(qkv.dtype), qkv], dim=1)
        last = inputs[:, -(self.kernel - 1) :]
        conv[-last.size(1) :, rows] = last.transpose(0, 1).to(conv.dtype)
        if last.size(1) < self.kernel - 1:  # a prompt shorter than the taps
            conv[: -last.size(1), rows] = 0
        rec[:, rows] = state.transpose(0, 1)
        return out.transpose(0, 1)

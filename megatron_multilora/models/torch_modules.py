"""Pure-torch submodules swapped into megatron's local layer spec where TE is absent.

They keep the constructor and forward contracts of the megatron modules they replace, so
the rest of the layer (and checkpoint keys) is unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_multilora.ops.grouped_mm import group_offsets, grouped_mm


class SDPAttention(MegatronModule):
    """Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

    Replaces megatron's ``DotProductAttention``, which allocates its score buffer on the
    CUDA device. Inputs are ``[s, b, heads, head_dim]`` (key/value with query-group heads,
    repeated for GQA); the output is ``[s, b, heads * head_dim]`` for this TP rank. A given
    mask is megatron's: bool, True = masked out. With ``packed_seq_params`` (``thd``: inputs
    ``[t, heads, head_dim]``) attention is causal within each packed sequence.

    A layer megatron's ``window_size`` / ``window_attn_skip_freq`` make a window layer attends
    to the last ``window_size[0] + 1`` positions only, itself included (Hugging Face's
    ``sliding_window``), in every path: unpacked, packed, one pass, flash varlen and the KV
    cache's decode steps (new queries sit at the end of the keys).

    megatron's ``softmax_type`` "off-by-one" and "learnable" add a sink per head: a logit
    (0, or the learned ``softmax_offset``) that joins every row's softmax and reads no value
    (gpt-oss's attention sinks); attention then runs as matmuls and a softmax, off SDPA.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ) -> None:
        # k_channels/v_channels (MLA: v heads narrower than q/k heads) need nothing here:
        # SDPA takes each from its input's shape.
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        self.attn_mask_type = attn_mask_type
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.softmax_scale = softmax_scale
        self.window = None
        if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number
        ):
            left, right = config.window_size
            if right != 0 or left < 0:
                raise ValueError(
                    f"window_size={config.window_size}: SDPAttention computes causal windows "
                    "(left, 0) with left >= 0"
                )
            self.window = left + 1
        heads = config.num_attention_heads // config.tensor_model_parallel_size
        if config.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads), persistent=False)
        elif config.softmax_type == "learnable":
            # This rank's heads' sinks; loaded with the base (zero until then).
            self.softmax_offset = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
            tensor_parallel.set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        elif config.softmax_type == "vanilla":
            self.softmax_offset = None
        else:
            raise ValueError(f"softmax_type={config.softmax_type!r} is not supported")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support attention_bias")
        mask_type = attn_mask_type or self.attn_mask_type
        if packed_seq_params is not None:
            if attention_mask is not None or mask_type != AttnMaskType.causal:
                raise ValueError(
                    "SDPAttention runs packed (thd) sequences causally, without a mask"
                )
            return self._packed(query, key, value, packed_seq_params)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        keep = None if attention_mask is None else ~attention_mask
        causal = keep is None and mask_type == AttnMaskType.causal
        if self.window is not None:
            # Causal or a KV cache's decode step (no_mask): the window ends at each query.
            band = window_keep(q.size(2), k.size(2), self.window, q.device)
            keep, causal = band if keep is None else keep & band, False
        out = self._attend(q, k, v, keep, causal)
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        keep: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        if self.softmax_offset is not None:
            return self._attend_with_sinks(q, k, v, keep, causal)
        dropout_p = self.dropout_p if self.training else 0.0
        # Heads are TP-sharded, so dropout draws from the tensor-parallel stream; without
        # dropout no stream is switched (on a GPU a switch reads and sets the generator's
        # state on the host, which a CUDA graph capture refuses).
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p else nullcontext():
            # enable_gqa: query groups share their key/value heads without copying them (a
            # copy of the whole KV cache per layer and token, when generating).
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=keep,
                dropout_p=dropout_p,
                is_causal=causal,
                scale=self.softmax_scale,
                enable_gqa=k.size(1) != q.size(1),
            )

    def _attend_with_sinks(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        keep: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """``softmax([q k^T * scale, sink]) [v; 0]``, as transformers' eager gpt-oss: the
        sink column takes its share of each row's probability and adds nothing."""
        if k.size(1) != q.size(1):  # query groups
            k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
        scale = self.softmax_scale if self.softmax_scale is not None else q.size(-1) ** -0.5
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale
        if causal:
            keep = window_keep(q.size(2), k.size(2), k.size(2), q.device)
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        sink = self.softmax_offset.to(scores.dtype).view(1, -1, 1, 1)
        sink = sink.expand(scores.size(0), -1, scores.size(2), 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        if self.training and self.dropout_p:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = F.dropout(probs, self.dropout_p)
        return torch.matmul(probs, v)

    def _packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: PackedSeqParams
    ) -> torch.Tensor:
        """``[t, heads, head_dim]`` packed sequences: causal attention within each sequence
        only, as batches of sequences of one :func:`padded_length`, right-padded to it (a
        causal row never reads its own sequence's padding; pad rows are dropped). Where
        ``params`` are marked by :func:`attend_in_one_pass`, one pass over every token with a
        mask of same-sequence causal pairs instead."""
        if getattr(params, "one_pass", False):
            if query.is_cuda:
                return self._varlen(query, key, value, params)
            keep = _same_sequence_causal(params.cu_seqlens_q, query.size(0))
            if self.window is not None:  # within one sequence, index distance = position's
                keep.triu_(1 - self.window)
            q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))  # [1,h,t,d]
            return self._attend(q, k, v, keep, False)[0].permute(1, 0, 2).flatten(1)
        layout = packed_layout(params, query.device)
        outs = []
        for rows in layout.buckets:  # rows: [n, padded] indices into the packed tokens
            q, k, v = (t[rows].permute(0, 2, 1, 3) for t in (query, key, value))  # [n, h, L, d]
            if self.window is None:
                out = self._attend(q, k, v, None, True)
            else:  # every sequence starts at row 0 of its bucket
                out = self._attend(
                    q, k, v, window_keep(q.size(2), q.size(2), self.window, q.device), False
                )
            outs.append(out.permute(0, 2, 1, 3).flatten(0, 1))
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        return out.index_select(0, layout.unpack).flatten(1)  # [t, heads * head_dim]

    def _varlen(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: PackedSeqParams
    ) -> torch.Tensor:
        """Flash attention over the packed sequences (``torch.nn.attention.varlen``): each
        sequence causal within itself, the query groups sharing their key/value heads, at
        about the sum of the sequences' squares; ``max_seqlen_q`` (a host int fixed for the
        run) bounds every sequence. Trailing zero-length sequences are skipped."""
        from torch.nn.attention.varlen import varlen_attn

        if self.softmax_offset is not None:
            raise ValueError("flash varlen attention has no sinks (softmax_type vanilla only)")

        bounds = params.cu_seqlens_q.int()
        longest = params.max_seqlen_q
        out = varlen_attn(
            query,
            key,
            value,
            bounds,
            bounds,
            longest,
            longest,
            scale=self.softmax_scale,
            window_size=(-1 if self.window is None else self.window - 1, 0),  # causal
            enable_gqa=key.size(1) != query.size(1),
        )
        return out.flatten(1)


@functools.lru_cache(maxsize=16)
def window_keep(queries: int, keys: int, window: int, device: torch.device) -> torch.Tensor:
    """``[queries, keys]`` bool: True where a query may attend to a key, the queries being the
    last positions of the keys (a whole sequence, or a KV cache's new tokens): causal, and
    fewer than ``window`` positions back. Cached: every window layer of a forward reads it."""
    at = torch.arange(keys - queries, keys, device=device).unsqueeze(1)
    key = torch.arange(keys, device=device).unsqueeze(0)
    return (key <= at) & (key > at - window)


def attend_in_one_pass(params: PackedSeqParams) -> PackedSeqParams:
    """Mark ``params`` so that :class:`SDPAttention` attends over the packed tokens in one
    call whose ops do not depend on the sequence lengths (trailing zero-length sequences
    allowed), with no host read: what a CUDA graph needs to replay one capture for every
    micro-batch of a length. On a GPU it is flash attention's varlen kernel (memory and time
    of about the sum of the sequences' squares; ``max_seqlen_q`` must bound every sequence);
    on the CPU, where that kernel does not exist and graphs do not run (the tests), one
    masked pass over all the pairs, built on the device from ``cu_seqlens_q``, whose rounding
    differs from the per-length batches by an ulp."""
    params.one_pass = True
    return params


def _same_sequence_causal(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[tokens, tokens]`` bool: True where row i may attend to column j (same sequence,
    j <= i)."""
    lengths = cu_seqlens.diff()
    sequence = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=tokens
    )
    same = sequence.unsqueeze(1) == sequence.unsqueeze(0)
    return same.tril_()


@dataclasses.dataclass(frozen=True)
class PackedBuckets:
    # Packed sequences as batches of one padded length each ([n, padded] token indices,
    # pads repeating the sequence's first token), and the way back.
    buckets: list[torch.Tensor]
    unpack: torch.Tensor  # for each packed token, its row in the concatenated bucket outputs


def padded_length(length: int) -> int:
    """The length a sequence is padded to for attention: its own length rounded up to a
    multiple of 4, or of a quarter of its leading power of two once that is larger (under
    25% padding past 16 tokens). A function of its length alone, so a sequence's attention
    does not depend on the sequences packed beside it: the CPU kernel rounds a row padded to
    another length differently by an ulp (seen at 5-13 tokens), harmless in fp32 but enough,
    once the frozen GEMMs round to bf16, to tell a job trained alone from one trained mixed."""
    step = max(4, 1 << max(0, length.bit_length() - 3))
    return -(-length // step) * step


def packed_layout(params: PackedSeqParams, device: torch.device) -> PackedBuckets:
    """Bucket the packed sequences by :func:`padded_length`, built once per micro-batch:
    every layer (attention and Gated DeltaNet alike) gets the same ``params`` object, which
    caches it."""
    cached = getattr(params, "_sdpa_layout", None)
    if cached is not None:
        return cached
    ends = getattr(params, "host_cu_seqlens", None) or params.cu_seqlens_q.tolist()
    starts, lengths = ends[:-1], [b - a for a, b in itertools.pairwise(ends)]
    by_length: dict[int, list[int]] = {}
    for i, length in enumerate(lengths):
        by_length.setdefault(padded_length(length), []).append(i)
    unpack = [0] * ends[-1]
    rows, offset = [], 0
    for padded, bucket in sorted(by_length.items()):
        index = torch.empty(len(bucket), padded, dtype=torch.int64)
        for n, i in enumerate(bucket):
            index[n, : lengths[i]] = torch.arange(starts[i], starts[i] + lengths[i])
            index[n, lengths[i] :] = starts[i]  # pads read the sequence's own first token
            unpack[starts[i] : starts[i] + lengths[i]] = range(
                offset + n * padded, offset + n * padded + lengths[i]
            )
        rows.append(index.to(device))
        offset += len(bucket) * padded
    layout = PackedBuckets(rows, torch.tensor(unpack, dtype=torch.int64, device=device))
    params._sdpa_layout = layout
    return layout


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


class TorchGroupedLinear(torch.nn.Module):
    """Transformer Engine's grouped expert linear, in pure torch.

    Same constructor and ``forward(x, m_splits) -> (out, None)`` as the TE grouped linears
    megatron's ``TEGroupedMLP`` builds, with one ``weight{i}`` ``[out, in]`` per local expert,
    so expert MLPs have the same module paths and checkpoint keys with and without TE. Rows of
    ``x`` are grouped by local expert (``m_splits[i]`` rows for expert i).

    With ``bias`` one ``bias{i}`` per expert: added to its rows, or (``skip_bias_add``, as
    megatron's fc2 wants them to weight by each row's routing probability) returned as
    ``[experts, out]``. Expert tensor parallelism is not supported.
    """

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method: Any,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None = None,
        pg_collection: Any = None,
        parallel_mode: str | None = None,
    ) -> None:
        super().__init__()
        if pg_collection is not None and pg_collection.expt_tp.size() > 1:
            raise ValueError("TorchGroupedLinear: expert tensor parallelism must be 1")
        self.num_gemms = num_gemms
        self.in_features, self.out_features = input_size, output_size
        self.config = config
        self.ep_group = pg_collection.ep if pg_collection is not None else None
        self.expt_dp_group = pg_collection.expt_dp if pg_collection is not None else None
        for i, w in enumerate(self._initial_weights(init_method)):
            param = torch.nn.Parameter(w)
            # Expert weights are reduced over the expert-data-parallel group by megatron DDP.
            param.allreduce = not is_expert
            self.register_parameter(f"weight{i}", param)
        self.use_bias, self.skip_bias_add = bias, skip_bias_add
        for i in range(num_gemms if bias else 0):
            # Zero, as TE's: loaded with the base.
            param = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype))
            param.allreduce = not is_expert
            self.register_parameter(f"bias{i}", param)

    def _initial_weights(self, init_method: Any) -> list[torch.Tensor]:
        """This rank's experts. With CPU initialisation every global expert is drawn in turn
        from the default generator and the local ones kept (as megatron's CPU init does for
        TP), so initial experts do not depend on the EP layout; on GPU each rank draws its
        own from megatron's expert-parallel RNG stream."""
        cfg = self.config
        shape = (self.out_features, self.in_features)
        # On the GPU they must be drawn there: a CPU tensor would draw from the CPU generator
        # whatever CUDA stream the tracker forks, giving every EP rank the same experts.
        device = "cpu" if cfg.use_cpu_initialization else torch.cuda.current_device()
        weights = [
            torch.empty(shape, dtype=cfg.params_dtype, device=device) for _ in range(self.num_gemms)
        ]
        if not cfg.perform_initialization:
            return weights
        if cfg.use_cpu_initialization:
            ep_size = self.ep_group.size() if self.ep_group is not None else 1
            ep_rank = self.ep_group.rank() if self.ep_group is not None else 0
            for g in range(ep_size * self.num_gemms):
                w = torch.empty(shape, dtype=torch.float32)
                init_method(w)
                if g // self.num_gemms == ep_rank:
                    weights[g % self.num_gemms].copy_(w)
            return weights
        from megatron.core.tensor_parallel.random import get_expert_parallel_rng_tracker_name

        with tensor_parallel.get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
            for w in weights:
                init_method(w)
        return weights

    def forward(
        self, x: torch.Tensor, m_splits: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        counts = [int(c) for c in m_splits]
        w = torch.stack([getattr(self, f"weight{i}") for i in range(self.num_gemms)])
        out = grouped_mm(x, w.to(x.dtype), group_offsets(counts, x.device), counts)
        if not self.use_bias:
            return out, None
        bias = torch.stack([getattr(self, f"bias{i}") for i in range(self.num_gemms)])
        if self.skip_bias_add:
            return out, bias
        rows = torch.cat([b.expand(c, -1) for b, c in zip(bias.to(out.dtype), counts)])
        return out + rows, None

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """``weight{i}`` as global expert ``ep_rank * num_gemms + i`` of one ``weight``
        tensor, the layout TE's grouped linears and megatron's SequentialMLP checkpoint."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        ep_size = self.ep_group.size() if self.ep_group is not None else 1
        ep_rank = self.ep_group.rank() if self.ep_group is not None else 0
        edp_rank = self.expt_dp_group.rank() if self.expt_dp_group is not None else 0
        out = {}
        for i in range(self.num_gemms):
            offsets = (
                *sharded_offsets,
                (len(sharded_offsets), ep_rank * self.num_gemms + i, ep_size * self.num_gemms),
            )
            for name in ("weight", "bias") if self.use_bias else ("weight",):
                out[f"{prefix}{name}{i}"] = ShardedTensor.from_rank_offsets(
                    f"{prefix}{name}",
                    getattr(self, f"{name}{i}"),
                    *offsets,
                    replica_id=(0, 0, edp_rank),
                    prepend_axis_num=len(offsets),
                )
        return out


class _AllReduceSum(torch.autograd.Function):
    """Sum over a process group in forward and backward.

    Every rank uses the sum, so the gradient of each rank's addend is the sum of all ranks'
    gradients of the result (megatron's reduce-from-TP region has an identity backward,
    which is only right when the consumer is replicated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class AcrossHeadsRMSNorm(torch.nn.Module):
    """RMSNorm over every head of a query or key projection (OLMoE's ``q_norm``/``k_norm``).

    Fills megatron's ``q_layernorm``/``k_layernorm`` slots, which are built with
    ``hidden_size`` = head_dim and normally normalise each head on its own. Input is
    ``[s, b, local_heads, head_dim]``; ``weight`` is ``[local_heads * head_dim]``, this TP
    rank's heads in projection-row order (TP-sharded on dim 0 like ``linear_qkv``'s rows).
    The mean square runs over all heads of all TP ranks: each rank's sum of squares is summed
    over the tensor-parallel group. ``projection`` is ``"query"`` (attention heads) or
    ``"key"`` (query groups). Computed in fp32 and cast back before the weight, as
    Hugging Face's RMSNorm does.
    """

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        projection: str = "query",
        **_: Any,
    ) -> None:
        super().__init__()
        if projection not in ("query", "key"):
            raise ValueError(f"AcrossHeadsRMSNorm: projection={projection!r}, use query or key")
        if config.normalization != "RMSNorm":
            raise ValueError(
                f"AcrossHeadsRMSNorm needs normalization='RMSNorm', got {config.normalization!r}"
            )
        heads = config.num_attention_heads if projection == "query" else config.num_query_groups
        tp = config.tensor_model_parallel_size
        self.eps = eps
        self.width = heads * hidden_size  # the full projection width the mean runs over
        self.weight = torch.nn.Parameter(
            torch.ones(heads // tp * hidden_size, dtype=config.params_dtype)
        )
        tensor_parallel.set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        self.tp_size = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state

        shape, dtype = x.shape, x.dtype
        flat = x.reshape(*shape[:-2], -1).float()
        square_sum = flat.pow(2).sum(-1, keepdim=True)
        if self.tp_size > 1:
            square_sum = _AllReduceSum.apply(
                square_sum, parallel_state.get_tensor_model_parallel_group()
            )
        normed = flat * torch.rsqrt(square_sum / self.width + self.eps)
        return (self.weight * normed.to(dtype)).view(shape)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """``weight`` as a TP-sharded tensor (split on dim 0), like the qkv rows."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets
        )

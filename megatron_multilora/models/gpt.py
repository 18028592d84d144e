"""Build a Megatron-core GPT model from a plain config."""

from __future__ import annotations

import dataclasses
from typing import Optional

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


@dataclasses.dataclass
class GPTModelConfig:
    """Architecture of a decoder-only GPT; every field maps onto megatron's config."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    """Key/value heads (GQA); None means one per attention head."""
    ffn_hidden_size: int = 128
    vocab_size: int = 256
    max_sequence_length: int = 512
    normalization: str = "RMSNorm"
    """RMSNorm or LayerNorm."""
    norm_epsilon: float = 1e-5
    activation: str = "silu"
    """silu, gelu or relu."""
    gated_linear_unit: bool = True
    """fc1 produces [gate; up] and the MLP computes act(gate) * up (SwiGLU with silu)."""
    position_embedding_type: str = "rope"
    """rope, learned_absolute or none."""
    rotary_base: int = 10000
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    qk_layernorm_across_heads: bool = False
    """With qk_layernorm: normalise q and k over the whole projection width (all heads, as
    OLMoE does) instead of each head on its own (Qwen3); RMSNorm only."""
    kv_channels: Optional[int] = None
    """Head dimension; None means hidden_size // num_attention_heads."""
    tie_word_embeddings: bool = False
    init_method_std: float = 0.02
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    # Mixture of experts (every layer's MLP when num_moe_experts is set).
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    """Per-expert FFN width; None means ffn_hidden_size."""
    moe_router_score_function: str = "softmax"
    """softmax or sigmoid."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before top-k (no renormalisation of the top-k probabilities);
    False applies softmax over the chosen top-k, i.e. renormalised."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing auxiliary loss weight; 0 disables it."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_token_dispatcher_type: str = "alltoall"
    """alltoall or allgather."""
    moe_shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(x @ gate_weight.T) (Qwen2-MoE)."""
    moe_router_dtype: Optional[str] = None
    """None (the model dtype), "fp32" or "fp64": precision of the router logits and softmax."""
    # Activation recompute.
    recompute_granularity: Optional[str] = None
    """"full" recomputes each transformer layer; "selective" the modules listed below."""
    recompute_modules: Optional[list[str]] = None
    """With selective recompute, e.g. ["moe"] or ["core_attn"] (megatron's names)."""

    def check(self, tensor_model_parallel_size: int, pipeline_model_parallel_size: int = 1,
              virtual_pipeline_model_parallel_size: Optional[int] = None) -> list[str]:
        """Problems with this config under the given parallel sizes; empty when fine."""
        tp = tensor_model_parallel_size
        groups = self.num_query_groups or self.num_attention_heads
        problems = []
        chunks = pipeline_model_parallel_size * (virtual_pipeline_model_parallel_size or 1)
        if self.num_layers % chunks:
            vpp = virtual_pipeline_model_parallel_size
            problems.append(
                f"num_layers={self.num_layers} does not split into pipeline "
                f"{pipeline_model_parallel_size} x virtual stages {vpp or 1} = {chunks} equal "
                f"model chunks; choose pipeline and virtual sizes whose product divides "
                f"{self.num_layers}")
        if self.num_attention_heads % groups:
            problems.append(f"num_attention_heads={self.num_attention_heads} is not divisible "
                            f"by num_query_groups={groups}")
        for name, value in (("num_attention_heads", self.num_attention_heads),
                            ("num_query_groups", groups), ("ffn_hidden_size", self.ffn_hidden_size),
                            ("vocab_size", self.vocab_size)):
            if value % tp:
                problems.append(f"{name}={value} is not divisible by tensor parallel size {tp}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            problems.append(f"hidden_size={self.hidden_size} is not divisible by "
                            f"num_attention_heads={self.num_attention_heads}; set kv_channels")
        if self.num_moe_experts is not None:
            if not 1 <= self.moe_router_topk <= self.num_moe_experts:
                problems.append(f"moe_router_topk={self.moe_router_topk} must be in "
                                f"1..num_moe_experts={self.num_moe_experts}")
            if (self.moe_router_topk == 1 and self.moe_router_score_function == "softmax"
                    and not self.moe_router_pre_softmax):
                problems.append("moe_router_topk=1 with softmax needs moe_router_pre_softmax=True "
                                "(a softmax over one chosen logit is always 1)")
            if self.moe_token_dispatcher_type not in ("alltoall", "allgather"):
                problems.append(f"moe_token_dispatcher_type={self.moe_token_dispatcher_type!r}: "
                                "use 'alltoall' or 'allgather'")
        for name, value, allowed in (
                ("normalization", self.normalization, ("RMSNorm", "LayerNorm")),
                ("position_embedding_type", self.position_embedding_type,
                 ("rope", "learned_absolute", "none")),
                ("moe_router_score_function", self.moe_router_score_function, ("softmax", "sigmoid")),
                ("recompute_granularity", self.recompute_granularity, (None, "full", "selective"))):
            if value not in allowed:
                problems.append(f"{name}={value!r}: choose one of {allowed}")
        if self.qk_layernorm_across_heads and not (self.qk_layernorm
                                                   and self.normalization == "RMSNorm"):
            problems.append("qk_layernorm_across_heads needs qk_layernorm=True and "
                            "normalization='RMSNorm'")
        if self.moe_router_dtype not in (None, "fp32", "fp64"):
            problems.append(f"moe_router_dtype={self.moe_router_dtype!r}: choose one of "
                            "(None, 'fp32', 'fp64')")
        if self.activation not in _ACTIVATIONS:
            problems.append(f"activation={self.activation!r}: choose one of {sorted(_ACTIVATIONS)}")
        return problems


def transformer_config(
    cfg: GPTModelConfig,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    **overrides: object,
) -> TransformerConfig:
    """megatron's TransformerConfig for ``cfg`` under the current parallel layout."""
    # Imported here, not at the top: config checks read GPTModelConfig and must not wait
    # seconds for megatron.
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    problems = cfg.check(tp, pp, vpp)
    if cfg.num_moe_experts is not None and cfg.num_moe_experts % ep:
        problems.append(f"num_moe_experts={cfg.num_moe_experts} is not divisible by expert "
                        f"parallel size {ep}")
    if problems:
        raise ValueError("invalid model config:\n  " + "\n  ".join(problems))
    if cfg.num_moe_experts is not None:
        overrides = {**_moe_settings(cfg, ep), **overrides}
    if cfg.recompute_granularity == "full":
        overrides = {"recompute_granularity": "full", "recompute_method": "uniform",
                     "recompute_num_layers": 1, **overrides}
    elif cfg.recompute_granularity == "selective":
        overrides = {"recompute_granularity": "selective",
                     "recompute_modules": cfg.recompute_modules or ["core_attn"], **overrides}
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.kv_channels,
        normalization=cfg.normalization,
        layernorm_epsilon=cfg.norm_epsilon,
        activation_func=_ACTIVATIONS[cfg.activation],
        gated_linear_unit=cfg.gated_linear_unit,
        add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias,
        qk_layernorm=cfg.qk_layernorm,
        init_method_std=cfg.init_method_std,
        attention_dropout=cfg.attention_dropout,
        hidden_dropout=cfg.hidden_dropout,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        # Interleaved stages with batched p2p mix up messages on gloo (a known upstream
        # issue); separate sends and receives keep them in order.
        batch_p2p_comm=vpp is None,
        # Under pipelining every micro-batch of a step is padded to one length, so stages
        # need not exchange shapes first.
        variable_seq_lengths=False,
        # On CPU, weights are initialised as full master tensors and split, which also makes
        # initial weights independent of the TP layout.
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        **overrides,
    )


def _moe_settings(cfg: GPTModelConfig, ep: int) -> dict:
    return dict(
        num_moe_experts=cfg.num_moe_experts,
        moe_router_topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
        moe_router_score_function=cfg.moe_router_score_function,
        moe_router_pre_softmax=cfg.moe_router_pre_softmax,
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if cfg.moe_aux_loss_coeff > 0 else "none",
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
        moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
        moe_shared_expert_gate=cfg.moe_shared_expert_gate,
        moe_router_dtype=cfg.moe_router_dtype,
        moe_grouped_gemm=True,
        moe_permute_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )


def build_gpt_model(
    cfg: GPTModelConfig,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    **config_overrides: object,
) -> GPTModel:
    """A GPTModel for ``cfg`` on the current parallel layout (call ``init_parallel`` first):
    the whole model without pipelining, this rank's stage with it (use
    :func:`build_model_chunks` for interleaved stages).

    ``config_overrides`` set further megatron TransformerConfig fields."""
    from megatron.core import parallel_state

    if parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None:
        raise ValueError("virtual pipeline stages give several model chunks per rank: use "
                         "build_model_chunks")
    (model,) = build_model_chunks(cfg, sequence_parallel, params_dtype, **config_overrides)
    return model


def build_model_chunks(
    cfg: GPTModelConfig,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    **config_overrides: object,
) -> list[GPTModel]:
    """This rank's model chunks for ``cfg``: one per virtual pipeline stage (one without
    virtual stages), in megatron's order, each holding its stage's layers, the embedding on
    the first stage and the output layer on the last.

    Base weights depend only on the default generator's seed (``torch.initial_seed()``, set
    by ``init_parallel`` or ``torch.manual_seed``) and, under CPU initialisation, not on the
    parallel layout: each transformer layer draws from a generator seeded by its global
    layer number (:class:`~megatron_multilora.models.specs.SeededTransformerLayer`), the
    embedding from the start of the stream and the output layer after the last layer. The
    generator is left after this rank's draws (what is drawn next, e.g. adapters, does not
    repeat the embedding's values)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from megatron_multilora.models.specs import gpt_block_spec

    config = transformer_config(cfg, sequence_parallel, params_dtype, **config_overrides)
    vpp = config.virtual_pipeline_model_parallel_size
    init_seed = torch.initial_seed()
    # From the start of the seed's stream: ranks may have drawn different amounts before.
    torch.manual_seed(init_seed)
    chunks = []
    for vp_stage in range(vpp) if vpp is not None else (None,):
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=gpt_block_spec(
                get_num_layers_to_build(config, vp_stage), cfg.qk_layernorm,
                cfg.num_moe_experts, cfg.qk_layernorm_across_heads, init_seed),
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.max_sequence_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                               vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                               vp_stage=vp_stage),
            share_embeddings_and_output_weights=cfg.tie_word_embeddings,
            position_embedding_type=cfg.position_embedding_type,
            rotary_base=cfg.rotary_base,
            vp_stage=vp_stage,
        ))
    if torch.cuda.is_available():
        for chunk in chunks:
            chunk.cuda()
    return chunks

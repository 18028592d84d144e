"""Build a Megatron-core GPT model from a plain config."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_multilora.models.gemma3 import gemma3_block_spec, scale_input_embeddings
from megatron_multilora.models.gpt_config import GPTModelConfig
from megatron_multilora.models.mla_config import mla_layout_problems
from megatron_multilora.models.specs import gpt_block_spec
from megatron_multilora.ops.packed_linear import use_packed_frozen_weights
from megatron_multilora.platform.missing_te import rope_fusion_available
from megatron_multilora.validation import model_layout_problems, schema_problems

# GPTModelConfig fields that TransformerConfig takes as they are, under the same name
_SAME_NAMED = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "kv_channels",
    "normalization",
    "gated_linear_unit",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "init_method_std",
    "attention_dropout",
    "hidden_dropout",
    "softmax_type",
    "glu_linear_offset",
    "attention_output_gate",
)
_MOE_SAME_NAMED = (
    "num_moe_experts",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_aux_loss_coeff",
    "moe_shared_expert_intermediate_size",
    "moe_token_dispatcher_type",
    "moe_shared_expert_gate",
    "moe_router_dtype",
    "moe_router_enable_expert_bias",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_topk_scaling_factor",
)


def transformer_config(
    cfg: GPTModelConfig,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    **overrides: object,
) -> TransformerConfig:
    """megatron's TransformerConfig for ``cfg`` under the current parallel layout."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    problems = schema_problems(cfg) or model_layout_problems(cfg, tp, pp, vpp, ep)
    if cfg.mla is not None:
        problems += mla_layout_problems(tp, sequence_parallel)
    if problems:
        raise ValueError("invalid model config:\n  " + "\n  ".join(problems))
    if cfg.num_moe_experts is not None:
        overrides = {**_moe_settings(cfg, ep), **overrides}
    if cfg.recompute_granularity == "full":
        overrides = {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
            **overrides,
        }
    elif cfg.recompute_granularity == "selective":
        overrides = {
            "recompute_granularity": "selective",
            "recompute_modules": cfg.recompute_modules or ["core_attn"],
            **overrides,
        }
    config_type = TransformerConfig
    if cfg.mla is not None:
        config_type = MLATransformerConfig
        overrides = {**cfg.mla.megatron_fields(cfg.rotary_base), **overrides}
    # One RoPE op per call (TE's, or ops/rope.py where TE is absent) instead of megatron's
    # unfused packed path, which splits the micro-batch into its sequences in every layer.
    overrides = {"apply_rope_fusion": rope_fusion_available(), **overrides}
    overrides = {**_window(cfg), **_linear_attention(cfg), **overrides}
    if cfg.no_rope_freq is not None and 1 in cfg.no_rope_freq:
        overrides = {"no_rope_freq": list(cfg.no_rope_freq), **overrides}
    # None: megatron's 1/sqrt(head dim); Gemma 3: query_pre_attn_scalar ** -0.5.
    overrides = {"softmax_scale": _softmax_scale(cfg), **overrides}
    config = config_type(
        **{field: getattr(cfg, field) for field in _SAME_NAMED},
        layernorm_epsilon=cfg.norm_epsilon,
        activation_func=_activation(cfg.activation),
        activation_func_clamp_value=cfg.activation_clamp,
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
        gradient_accumulation_fusion=False,
        **overrides,
    )
    if cfg.yarn is not None:  # what megatron's GPTModel reads for its YarnRotaryEmbedding
        config.yarn_rotary_scaling_factor = cfg.yarn.factor
        config.yarn_original_max_position_embeddings = cfg.yarn.original_max_positions
        config.yarn_beta_fast, config.yarn_beta_slow = cfg.yarn.beta_fast, cfg.yarn.beta_slow
        # A concentration of m(factor, 1) / m(factor, 1) = 1 on q and k: megatron's fused
        # packed (thd) RoPE drops it, the unfused one applies it; _softmax_scale carries it.
        config.yarn_mscale = config.yarn_mscale_all_dim = 1.0
        config.yarn_correction_range_round_to_int = cfg.yarn.truncate
    if _renormalised_top1(cfg):
        # megatron refuses a softmax over the one chosen logit (its weight is always 1, so the
        # router would get no gradient); the base, router included, is frozen here, and that
        # weight of 1 is exactly what a renormalising top-1 model (Mixtral with
        # num_experts_per_tok=1) computes. It is constructed pre-softmax and switched back.
        config.moe_router_pre_softmax = False
    return config


def _softmax_scale(cfg: GPTModelConfig) -> float | None:
    """The attention logits' scale. Under YaRN, cos and sin carry its attention factor: q and
    k both, so the logits its square. It goes into the scale (RoPE covers the whole head), the
    same in every RoPE path of megatron's (its fused packed one would drop it)."""
    if cfg.yarn is None:
        return cfg.softmax_scale
    head = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    return (cfg.softmax_scale or head**-0.5) * cfg.yarn.concentration() ** 2


def _window(cfg: GPTModelConfig) -> dict:
    """megatron's sliding-window fields: (left, right) positions besides the query's own, and
    which layers have it (a list by layer; None: all)."""
    if cfg.sliding_window is None:
        return {}
    layers = None
    if cfg.layer_types is not None:
        layers = [int(kind == "sliding_attention") for kind in cfg.layer_types]
    return {"window_size": (cfg.sliding_window - 1, 0), "window_attn_skip_freq": layers}


def _linear_attention(cfg: GPTModelConfig) -> dict:
    """megatron's Gated DeltaNet fields: its shape, and which layers (1) have it."""
    if cfg.linear_attention is None:
        return {}
    return {
        **dataclasses.asdict(cfg.linear_attention),
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": _linear_layers(cfg, 0, cfg.num_layers),
    }


def _linear_layers(cfg: GPTModelConfig, offset: int, num_layers: int) -> list[int]:
    """Per layer of a chunk (global ``offset`` on), 1 for a Gated DeltaNet layer."""
    types = cfg.layer_types or ["full_attention"] * cfg.num_layers
    return [int(kind == "linear_attention") for kind in types[offset : offset + num_layers]]


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP activation named in gpt_config.ACTIVATIONS."""
    if name == "gelu_tanh":
        return functools.partial(F.gelu, approximate="tanh")
    if name == "quick_gelu":
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        return quick_gelu
    return getattr(F, name)


def _renormalised_top1(cfg: GPTModelConfig) -> bool:
    return (
        cfg.num_moe_experts is not None
        and cfg.moe_router_topk == 1
        and cfg.moe_router_score_function == "softmax"
        and not cfg.moe_router_pre_softmax
    )


def _moe_layers(cfg: GPTModelConfig, offset: int, num_layers: int) -> list[bool] | None:
    """Which of a chunk's layers (global ``offset`` on) have an MoE MLP; None: all alike."""
    if cfg.moe_layer_freq is None:
        return None
    return [bool(x) for x in cfg.moe_layer_freq[offset : offset + num_layers]]


def _moe_settings(cfg: GPTModelConfig, ep: int) -> dict:
    return dict(
        **{field: getattr(cfg, field) for field in _MOE_SAME_NAMED},
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
        moe_router_pre_softmax=cfg.moe_router_pre_softmax or _renormalised_top1(cfg),
        moe_router_load_balancing_type="aux_loss" if cfg.moe_aux_loss_coeff > 0 else "none",
        moe_layer_freq=cfg.moe_layer_freq or 1,
        # The base (router included) is frozen here: an expert bias stays as loaded.
        moe_router_bias_update_rate=0.0,
        moe_grouped_gemm=True,
        moe_permute_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )


def _llama3_rope_bands(chunk: GPTModel, cfg: GPTModelConfig) -> None:
    """megatron's RoPE passes only the Llama 3 scaling factor on to its ``_apply_scaling``
    and keeps that function's defaults for the frequency bands (1, 4, 8192); recompute the
    angles with the checkpoint's."""
    rope = getattr(chunk, "rotary_pos_emb", None)
    if cfg.rope_scaling_factor is None or rope is None:
        return
    dim = rope.inv_freq.numel() * 2
    unscaled = 1.0 / (cfg.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rope.inv_freq = rope._apply_scaling(
        unscaled.to(rope.inv_freq.device),
        factor=cfg.rope_scaling_factor,
        low_freq_factor=cfg.rope_low_freq_factor,
        high_freq_factor=cfg.rope_high_freq_factor,
        original_max_position_embeddings=cfg.rope_original_max_positions,
    )


def build_gpt_model(
    cfg: GPTModelConfig,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    cpu_gemm_dtype: torch.dtype = torch.float32,
    **config_overrides: object,
) -> GPTModel:
    """A GPTModel for ``cfg`` on the current parallel layout (call ``init_parallel`` first):
    the whole model without pipelining, this rank's stage with it (use
    :func:`build_model_chunks` for interleaved stages).

    ``cpu_gemm_dtype`` as for :func:`build_model_chunks`; ``config_overrides`` set further
    megatron TransformerConfig fields."""
    if parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None:
        raise ValueError(
            "virtual pipeline stages give several model chunks per rank: use build_model_chunks"
        )
    (model,) = build_model_chunks(
        cfg, sequence_parallel, params_dtype, cpu_gemm_dtype, **config_overrides
    )
    return model


def build_model_chunks(
    cfg: GPTModelConfig,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    cpu_gemm_dtype: torch.dtype = torch.float32,
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
    repeat the embedding's values). On CPU the frozen linears' forwards run on weights packed
    once (:mod:`megatron_multilora.ops.packed_linear`), an fp32 model's GEMMs in
    ``cpu_gemm_dtype`` (bf16: rounded to bf16 on the way in, fp32 out)."""
    config = transformer_config(cfg, sequence_parallel, params_dtype, **config_overrides)
    vpp = config.virtual_pipeline_model_parallel_size
    init_seed = torch.initial_seed()
    # From the start of the seed's stream: ranks may have drawn different amounts before.
    torch.manual_seed(init_seed)
    chunks = []
    for vp_stage in range(vpp) if vpp is not None else (None,):
        num_layers = get_num_layers_to_build(config, vp_stage)
        offset = get_transformer_layer_offset(config, vp_stage)
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=gemma3_block_spec(
                    gpt_block_spec(
                        num_layers,
                        cfg.qk_layernorm,
                        cfg.num_moe_experts,
                        cfg.qk_layernorm_across_heads,
                        init_seed,
                        multi_latent_attention=cfg.mla is not None,
                        moe_layers=_moe_layers(cfg, offset, num_layers),
                        linear_layers=_linear_layers(cfg, offset, num_layers),
                    ),
                    config,
                    cfg,
                ),
                vocab_size=cfg.vocab_size,
                max_sequence_length=cfg.max_sequence_length,
                pre_process=parallel_state.is_pipeline_first_stage(
                    ignore_virtual=False, vp_stage=vp_stage
                ),
                post_process=parallel_state.is_pipeline_last_stage(
                    ignore_virtual=False, vp_stage=vp_stage
                ),
                share_embeddings_and_output_weights=cfg.tie_word_embeddings,
                position_embedding_type="yarn" if cfg.yarn else cfg.position_embedding_type,
                rotary_base=cfg.rotary_base,
                rotary_percent=cfg.rotary_percent,
                rope_scaling=cfg.rope_scaling_factor is not None,
                rope_scaling_factor=cfg.rope_scaling_factor or 8.0,
                seq_len_interpolation_factor=cfg.seq_len_interpolation_factor,
                vp_stage=vp_stage,
            )
        )
    for chunk in chunks:
        _llama3_rope_bands(chunk, cfg)
        scale_input_embeddings(chunk, cfg)
        if torch.cuda.is_available():
            chunk.cuda()
        else:
            use_packed_frozen_weights(chunk, cpu_gemm_dtype)
    return chunks

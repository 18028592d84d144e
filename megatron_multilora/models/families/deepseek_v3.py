"""DeepSeek-V3 (``model_type: deepseek_v3``): its ``config.json`` as a :class:`GPTModelConfig`
with megatron's multi-latent attention and sigmoid-routed MoE, and the names of its MLA
tensors.

What megatron reproduces and how (checked against transformers' logits in the tests):

* MLA: ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` (or ``q_proj`` without ``q_lora_rank``),
  ``kv_a_proj_with_mqa`` (rows ``[kv_lora_rank; qk_rope_head_dim]``, megatron's split order
  too), ``kv_a_layernorm``, ``kv_b_proj`` (per head ``[k_nope; v]``), ``o_proj``: the same
  tensors, no permutation. HF's ``rope_interleave=True`` rotates channel pairs (0, 1), (2, 3),
  ...; megatron's unfused MLA RoPE de-interleaves them the same way. ``rope_interleave=False``
  is refused.
* RoPE: plain, or YaRN where megatron's ``mscale``/``mscale_all_dim`` (cos/sin and softmax
  scaling) give transformers' values.
* Router: sigmoid scores, ``e_score_correction_bias`` (megatron's ``expert_bias``, a frozen
  buffer) for the choice only, group-limited top-k (transformers ranks a group by its top two
  scores, megatron by its top ``topk // topk_group``: they must be 2), renormalised top-k
  (megatron renormalises exactly when top-k > 1), ``routed_scaling_factor``.
* ``first_k_dense_replace`` dense layers (``intermediate_size``) first, MoE after
  (``moe_intermediate_size``, ``n_shared_experts`` shared experts as one wider MLP).
* Multi-token-prediction layers a checkpoint appends (past ``num_hidden_layers``) are
  skipped, as transformers skips them.

Under TP megatron's MLA splits heads; its q/kv down-projections are replicated (TE's
duplicated linears, torch ones without TE: ``models/mla_spec.py``, which also says why TP > 1
needs sequence parallelism) and read the sequence shard under SP (their LoRA layout:
``layers/sharding.py``).
"""

from __future__ import annotations

import math
import re
from typing import Any

from megatron_multilora.models.families.family import Family, Fields
from megatron_multilora.models.gpt_config import GPTModelConfig
from megatron_multilora.models.mla_config import MLAConfig

# Megatron MLA parameter (below decoder.layers.i.) -> HF tensor (below model.layers.i.);
# TE specs fuse the latent norms into the up-projections (``layer_norm_weight``).
MLA_TENSORS = {
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
}

# Megatron MLA linear -> the HF module PEFT adapters name (the same rows, not fused).
MLA_PEFT_MODULES = {
    "self_attention.linear_q_proj": "self_attn.q_proj",
    "self_attention.linear_q_down_proj": "self_attn.q_a_proj",
    "self_attention.linear_q_up_proj": "self_attn.q_b_proj",
    "self_attention.linear_kv_down_proj": "self_attn.kv_a_proj_with_mqa",
    "self_attention.linear_kv_up_proj": "self_attn.kv_b_proj",
}


def prediction_module_tensor(name: str, num_layers: int) -> bool:
    """A tensor of the multi-token-prediction modules DeepSeek-V3 checkpoints append as
    layers ``num_layers`` on: no part of the causal LM (transformers skips them too)."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return m is not None and int(m[1]) >= num_layers


def deepseek_v3_config(hf: Fields) -> GPTModelConfig:
    """The :class:`GPTModelConfig` of a DeepSeek-V3 ``config.json`` (see the module
    docstring); ``ValueError`` naming the field for what megatron would compute otherwise."""
    heads = hf.require("num_attention_heads")
    layers = hf.require("num_hidden_layers")
    _check(hf, heads)
    rope_theta = _rope_parameters(hf).get("rope_theta", hf.get("rope_theta", 10000.0))
    cfg = GPTModelConfig(
        num_layers=layers,
        hidden_size=hf.require("hidden_size"),
        num_attention_heads=heads,
        num_query_groups=heads,
        ffn_hidden_size=hf.require("intermediate_size"),
        vocab_size=hf.require("vocab_size"),
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        normalization="RMSNorm",
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        activation="silu",
        gated_linear_unit=True,
        position_embedding_type="rope",
        rotary_base=int(rope_theta) if float(rope_theta).is_integer() else rope_theta,
        qk_layernorm=True,  # the q and kv latent norms
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        hidden_dropout=0.0,
        mla=MLAConfig(
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf.require("kv_lora_rank"),
            qk_head_dim=hf.require("qk_nope_head_dim"),
            qk_pos_emb_head_dim=hf.require("qk_rope_head_dim"),
            v_head_dim=hf.require("v_head_dim"),
            **_yarn(hf),
        ),
    )
    dense = min(int(hf.get("first_k_dense_replace", 0)), layers)
    if dense < layers:
        add_sigmoid_moe(hf, cfg, [0] * dense + [1] * (layers - dense))
    return cfg


def _check(hf: Fields, heads: int) -> None:
    for name, want in (
        ("hidden_act", "silu"),
        ("attention_bias", False),
        ("pretraining_tp", 1),
        ("rope_interleave", True),
        ("num_key_value_heads", heads),
        # fields of DeepSeek's own config.json that transformers' class does not read
        ("scoring_func", "sigmoid"),
        ("topk_method", "noaux_tc"),
    ):
        if hf.get(name, want) != want:
            hf.reject(name, hf.d[name], f"only {name}={want!r} is implemented")


def _rope_parameters(hf: Fields) -> dict:
    return {**(hf.d.get("rope_parameters") or {}), **(hf.d.get("rope_scaling") or {})}


def _yarn(hf: Fields) -> dict[str, Any]:
    """MLAConfig's RoPE fields: plain RoPE, or YaRN as transformers computes it (whose
    cos/sin factor is ``m(factor, mscale) / m(factor, mscale_all_dim)`` only when both are
    set, else ``m(factor, 1)``; the softmax scale takes ``m(factor, mscale_all_dim)**2``)."""
    params = _rope_parameters(hf)
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        hf.reject(
            "partial_rotary_factor", params["partial_rotary_factor"], "RoPE covers qk_rope_head_dim"
        )
    if kind == "default":
        return {"rope_type": "rope"}
    if kind != "yarn":
        hf.reject("rope_parameters", params, "only unscaled RoPE and YaRN are implemented")
    original = int(params["original_max_position_embeddings"])
    factor = float(params.get("factor") or hf.require("max_position_embeddings") / original)
    mscale, all_dim = params.get("mscale") or 0.0, params.get("mscale_all_dim") or 0.0
    if not (mscale and all_dim):
        if all_dim:  # cos/sin by m(factor, 1) but the softmax by m(factor, all_dim)**2
            hf.reject("rope_parameters", params, "YaRN mscale_all_dim without mscale")
        mscale, all_dim = 1.0, 0.0  # megatron: m(factor, 1) / 1
    attention_factor = params.get("attention_factor")
    if attention_factor is not None and not math.isclose(
        attention_factor, _m(factor, mscale) / _m(factor, all_dim)
    ):
        hf.reject("attention_factor", attention_factor, "megatron derives it from the mscales")
    if not params.get("truncate", True):
        hf.reject("truncate", False, "megatron rounds YaRN's correction range to integers")
    return dict(
        rope_type="yarn",
        rotary_scaling_factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(mscale),
        mscale_all_dim=float(all_dim),
    )


def _m(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction (transformers' ``yarn_get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def add_sigmoid_moe(hf: Fields, cfg: GPTModelConfig, moe_layers: list[int]) -> None:
    """DeepSeek-V3's MoE (also GLM-4.5's) in the layers ``moe_layers`` marks: sigmoid router
    with the expert bias, group-limited top-k, routed scaling, shared experts."""
    experts = int(hf.require("n_routed_experts"))
    topk = int(hf.require("num_experts_per_tok"))
    if bool(hf.get("norm_topk_prob", True)) != (topk > 1):
        # megatron's sigmoid router renormalises the chosen weights exactly when topk > 1
        hf.reject(
            "norm_topk_prob", hf.get("norm_topk_prob", True), f"with num_experts_per_tok={topk}"
        )
    cfg.num_moe_experts = experts
    cfg.moe_router_topk = topk
    cfg.moe_ffn_hidden_size = int(hf.require("moe_intermediate_size"))
    cfg.moe_layer_freq = moe_layers
    cfg.moe_router_score_function = "sigmoid"
    cfg.moe_router_enable_expert_bias = True
    cfg.moe_router_dtype = "fp32"  # transformers routes in fp32
    cfg.moe_aux_loss_coeff = 0.0
    scaling = float(hf.get("routed_scaling_factor", 1.0))
    cfg.moe_router_topk_scaling_factor = None if scaling == 1.0 else scaling
    shared = int(hf.get("n_shared_experts") or 0)
    if shared:
        cfg.moe_shared_expert_intermediate_size = shared * cfg.moe_ffn_hidden_size
    groups, group_topk = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    if groups > 1 and experts % groups:
        hf.reject("n_group", groups, f"n_routed_experts={experts} must split into the groups")
    if groups > 1 and topk // group_topk != 2:
        # transformers ranks a group by its top 2 scores, megatron by its top k // topk_group
        hf.reject(
            "n_group",
            groups,
            f"with num_experts_per_tok={topk} // topk_group={group_topk} != 2 megatron "
            "ranks expert groups by another number of top scores than transformers (2)",
        )
    if groups > 1:
        cfg.moe_router_num_groups, cfg.moe_router_group_topk = groups, group_topk


FAMILY = Family(
    "deepseek_v3",
    config=deepseek_v3_config,
    layer_tensors=MLA_TENSORS,
    shared_experts="shared_experts",
    skipped=prediction_module_tensor,
    own_modules=MLA_PEFT_MODULES,
)

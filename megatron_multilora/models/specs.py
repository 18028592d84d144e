"""Layer specs: Transformer Engine where it runs, megatron's local spec elsewhere.

Without TE (or without CUDA) the local spec is used with its attention and norm swapped,
through the ModuleSpec, for the pure-torch modules in :mod:`.torch_modules`.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from megatron_multilora.models.gated_delta_net import (
    GatedDeltaNet,
    GatedDeltaNetSubmodules,
    GatedRMSNorm,
)
from megatron_multilora.models.mla_spec import mla_cpu_submodules
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
        return TEGroupedMLP, MLPSubmodules(
            linear_fc1=TorchGroupedLinear, linear_fc2=TorchGroupedLinear
        )


def transformer_engine_usable() -> bool:
    """TE is importable and there is a GPU for it to run on."""
    return gpt_layer_specs.HAVE_TE and torch.cuda.is_available()


class SeededTransformerLayer(TransformerLayer):
    """megatron's TransformerLayer whose weights are drawn from the default generator
    reseeded from ``init_seed`` and the layer's global number.

    Without it a layer's initial weights depend on how many draws came before it on its
    rank, i.e. on the pipeline layout. The generator is left at the end of this layer's
    draws, so what is built after the last layer (the output layer) draws the same values
    on every layout too. (On GPU megatron draws TP-split weights from its tracker's
    per-TP-rank stream instead, so there init stays layout-dependent, as in megatron.)"""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: float | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        vp_stage: int | None = None,
        *,
        init_seed: int,
    ) -> None:
        pp_rank = None if pg_collection is None else pg_collection.pp.rank()
        # The 1-based global number, as TransformerLayer computes it.
        global_number = layer_number + get_transformer_layer_offset(config, vp_stage, pp_rank)
        torch.manual_seed((init_seed + 1_000_003 * global_number) % 2**63)
        super().__init__(config, submodules, layer_number, hidden_dropout, pg_collection, vp_stage)


def gpt_block_spec(
    num_layers: int,
    qk_layernorm: bool = False,
    num_experts: int | None = None,
    qk_layernorm_across_heads: bool = False,
    init_seed: int = 0,
    multi_latent_attention: bool = False,
    moe_layers: list[bool] | None = None,
    linear_layers: list[int] | None = None,
) -> TransformerBlockSubmodules:
    """The decoder-block spec for ``num_layers`` layers of a GPT (one pipeline chunk's
    layers; MoE MLPs with experts), each a :class:`SeededTransformerLayer` for ``init_seed``.

    ``qk_layernorm_across_heads`` swaps the per-head q/k norms for :class:`AcrossHeadsRMSNorm`
    (one RMSNorm over the whole q or k projection, as OLMoE has). ``multi_latent_attention``
    builds megatron's MLA (its q/kv latent norms are the q/k norms). ``moe_layers``: per layer
    of this chunk, whether its MLP is the MoE one (None: all, when there are experts);
    ``linear_layers``: per layer, 1 where a Gated DeltaNet takes attention's place."""
    if moe_layers is None:
        moe_layers = [num_experts is not None] * num_layers
    kinds = list(zip(moe_layers, linear_layers or [0] * num_layers))
    specs = {
        (moe, linear): _layer_spec(
            qk_layernorm,
            num_experts if moe else None,
            qk_layernorm_across_heads,
            init_seed,
            multi_latent_attention,
            bool(linear),
        )
        for moe, linear in set(kinds)
    }
    if transformer_engine_usable():
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    else:
        final_norm = TorchNorm
    return TransformerBlockSubmodules(
        layer_specs=[specs[kind] for kind in kinds], layer_norm=final_norm
    )


def _layer_spec(
    qk_layernorm: bool,
    num_experts: int | None,
    qk_layernorm_across_heads: bool,
    init_seed: int,
    multi_latent_attention: bool,
    linear_attention: bool = False,
) -> ModuleSpec:
    """One layer's spec (see :func:`gpt_block_spec`); a dense MLP without experts."""
    if transformer_engine_usable():
        layer = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts,
            moe_grouped_gemm=num_experts is not None,
            qk_layernorm=qk_layernorm,
            multi_latent_attention=multi_latent_attention,
        )
    else:
        layer = gpt_layer_specs.get_gpt_layer_local_spec(
            qk_layernorm=qk_layernorm, multi_latent_attention=multi_latent_attention
        )
        layer = torch_layer_spec(layer, qk_layernorm, num_experts)
    if qk_layernorm_across_heads:
        layer = across_heads_qk_norm_spec(layer)
    if linear_attention:
        layer = gated_delta_net_spec(layer)
    return dataclasses.replace(
        layer, module=SeededTransformerLayer, params={**layer.params, "init_seed": init_seed}
    )


def gated_delta_net_spec(layer: ModuleSpec) -> ModuleSpec:
    """``layer`` with a Gated DeltaNet in attention's place, its input norm unfused."""
    norm = layer.submodules.input_layernorm
    if norm is IdentityOp:  # TE's spec fuses it into linear_qkv
        from megatron.core.extensions.transformer_engine import TENorm as norm
    net = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=GatedRMSNorm, out_proj=RowParallelLinear
        ),
    )
    return dataclasses.replace(
        layer,
        submodules=dataclasses.replace(layer.submodules, input_layernorm=norm, self_attention=net),
    )


def across_heads_qk_norm_spec(layer: ModuleSpec) -> ModuleSpec:
    """``layer`` with its q/k norms replaced by RMSNorms over all heads of the projection."""
    attn = layer.submodules.self_attention
    attn_sub = dataclasses.replace(
        attn.submodules,
        q_layernorm=ModuleSpec(module=AcrossHeadsRMSNorm, params={"projection": "query"}),
        k_layernorm=ModuleSpec(module=AcrossHeadsRMSNorm, params={"projection": "key"}),
    )
    return dataclasses.replace(
        layer,
        submodules=dataclasses.replace(
            layer.submodules, self_attention=dataclasses.replace(attn, submodules=attn_sub)
        ),
    )


def torch_layer_spec(
    layer: ModuleSpec, qk_layernorm: bool, num_experts: int | None = None
) -> ModuleSpec:
    """Swap the CUDA-only/non-SP submodules of a local layer spec for pure-torch ones."""
    attn = layer.submodules.self_attention
    attn_sub = dataclasses.replace(attn.submodules, core_attention=SDPAttention)
    if isinstance(attn_sub, MLASelfAttentionSubmodules):
        attn_sub = mla_cpu_submodules(attn_sub, qk_layernorm)
    elif qk_layernorm:
        attn_sub = dataclasses.replace(attn_sub, q_layernorm=TorchNorm, k_layernorm=TorchNorm)
    layer_sub = dataclasses.replace(
        layer.submodules,
        input_layernorm=TorchNorm,
        pre_mlp_layernorm=TorchNorm,
        self_attention=dataclasses.replace(attn, submodules=attn_sub),
    )
    if num_experts is not None:
        layer_sub = dataclasses.replace(
            layer_sub,
            mlp=get_moe_module_spec_for_backend(
                TorchSpecProvider(), num_experts=num_experts, moe_grouped_gemm=True
            ),
        )
    return dataclasses.replace(layer, submodules=layer_sub)

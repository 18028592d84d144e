"""What megatron-core 0.16.1 needs where Transformer Engine is not installed, on any device.

moe/moe_utils.py imports ``te_general_gemm`` only when TE imports, yet its router gating
(``RouterGatingLinearFunction``, every TopKRouter forward) names it either way: without TE
each MoE forward raises ``NameError``, on a GPU machine as on CPU. Defined as None, megatron
takes its own ``torch.mm`` branch for that case.

rope_utils takes its fused RoPE (``apply_rope_fusion``) from TE too; without it, megatron's
unfused packed path splits every micro-batch into its sequences on each call, in every layer
(a host read and many small ops). :mod:`megatron_multilora.ops.rope` stands in for TE's two
functions, so the fused path runs, one op per call, wherever TE is absent.

multi_latent_attention.py sets ``HAVE_TE`` when megatron's TE extension module imports, which
it does without TE too, with mock stand-ins for TE's classes: MLA's constructor then calls
``isinstance`` on a mock and raises. Where those names are not classes, ``HAVE_TE`` is False.
"""

from __future__ import annotations

import importlib

from megatron_multilora.ops.rope import apply_rope, apply_rope_packed


def define_missing_te_names() -> None:
    """Where TE did not import them: the TE names megatron uses unconditionally, and stand-ins
    for TE's fused RoPE (so ``apply_rope_fusion`` can be set, see :func:`rope_fusion_available`)."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    rope_utils = importlib.import_module("megatron.core.models.common.embeddings.rope_utils")
    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = apply_rope
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = apply_rope_packed
    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    if not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False


def rope_fusion_available() -> bool:
    """Whether megatron has a fused RoPE to call (TE's, or ours once
    :func:`define_missing_te_names` ran)."""
    rope_utils = importlib.import_module("megatron.core.models.common.embeddings.rope_utils")
    return (
        rope_utils.fused_apply_rotary_pos_emb is not None
        and rope_utils.fused_apply_rotary_pos_emb_thd is not None
    )

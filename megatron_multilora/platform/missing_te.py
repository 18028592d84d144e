"""What megatron-core 0.16.1 needs where Transformer Engine is not installed, on any device.

moe/moe_utils.py imports ``te_general_gemm`` only when TE imports, yet its router gating
(``RouterGatingLinearFunction``, every TopKRouter forward) names it either way: without TE
each MoE forward raises ``NameError``, on a GPU machine as on CPU. Defined as None, megatron
takes its own ``torch.mm`` branch for that case.
"""

from __future__ import annotations

import importlib


def define_missing_te_names() -> None:
    """Define the TE names megatron uses unconditionally, where TE did not import them."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

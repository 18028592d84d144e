"""Qwen2-MoE (``qwen2_moe``): every layer MoE (``moe_intermediate_size`` experts) with one
gated shared expert (``shared_expert``, ``shared_expert_gate``), q/k/v biases per
``qkv_bias``; with ``use_sliding_window``, a window in every other layer below
``max_window_layers``."""

import functools

from megatron_multilora.models.families.family import Family, Fields, named_layer_types


def every_layer_moe(hf: Fields) -> None:
    """The Qwen MoE families' fields that put dense layers into the stack: refused."""
    if hf.get("mlp_only_layers", []):
        hf.reject(
            "mlp_only_layers",
            hf.d["mlp_only_layers"],
            "dense layers inside an MoE stack are not supported",
        )
    if hf.get("decoder_sparse_step", 1) != 1:
        hf.reject(
            "decoder_sparse_step", hf.d["decoder_sparse_step"], "every layer must be an MoE layer"
        )


def _windows(hf: Fields) -> list[str]:
    """Its layer types before config.json named them (transformers' rule)."""
    on, below = hf.get("use_sliding_window", False), hf.get("max_window_layers", 28)
    return [
        "sliding_attention" if on and i % 2 == 0 and i < below else "full_attention"
        for i in range(hf.get("num_hidden_layers", 0))
    ]


FAMILY = Family(
    "qwen2_moe",
    moe=True,
    qkv_bias=lambda hf: bool(hf.get("qkv_bias", True)),
    check=every_layer_moe,
    expert_width="moe_intermediate_size",
    shared_expert_gate=True,
    window_layers=functools.partial(named_layer_types, rule=_windows),
)

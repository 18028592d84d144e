"""gpt-oss (``gpt_oss``): attention with biases on q, k, v and o and a learned sink per head
(megatron's ``softmax_type: learnable``), layers alternating sliding-window and full
attention, YaRN RoPE, and MoE layers whose router and experts have biases, the router's
softmax over its top-k logits, the experts' GLU clamped (``swiglu_limit``) with quick GELU
(``swiglu_alpha`` 1.702) and ``up + 1``.

Its experts are stored fused, ``gate_up_proj [E, H, 2I]`` with gate and up interleaved by
column and ``down_proj [E, I, H]`` (in, out), with ``*_bias``; or in MXFP4 (``*_blocks``,
``*_scales``), dequantized by transformers' own function. Megatron's fc1 takes ``[gate; up]``
rows: the columns are de-interleaved here.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from megatron_multilora.models.families.family import Family, Fields, named_layer_types
from megatron_multilora.models.gpt_config import GPTModelConfig

_QUICK_GELU_ALPHA = 1.702  # megatron's quick_gelu


def _alternating(hf: Fields) -> list[str]:
    """transformers' rule: even layers sliding, odd ones full."""
    return [
        "sliding_attention" if (i + 1) % 2 else "full_attention"
        for i in range(hf.get("num_hidden_layers", 0))
    ]


def _finish(hf: Fields, cfg: GPTModelConfig) -> None:
    alpha = float(hf.get("swiglu_alpha", _QUICK_GELU_ALPHA))
    if not math.isclose(alpha, _QUICK_GELU_ALPHA):
        hf.reject("swiglu_alpha", alpha, f"megatron's quick GELU has {_QUICK_GELU_ALPHA}")
    if not hf.get("attention_bias", True):
        hf.reject("attention_bias", False, "gpt-oss's linears all have biases")
    cfg.add_bias_linear = True  # o_proj, the router and the experts; q/k/v via the flag
    cfg.softmax_type = "learnable"
    cfg.activation = "quick_gelu"
    cfg.activation_clamp = float(hf.get("swiglu_limit", 7.0))
    cfg.glu_linear_offset = 1.0


def expert_tensor(ckpt: Any, experts: str, e: int, fc: str, part: str) -> torch.Tensor:
    """Expert ``e``'s megatron fc1 (``[gate; up]``) or fc2 weight ``[out, in]`` or bias."""
    name = f"{experts}.{'gate_up_proj' if fc == 'fc1' else 'down_proj'}"
    if part == "bias":
        tensor = _read(ckpt, f"{name}_bias", e)
    else:
        tensor = _read_weight(ckpt, name, e).t()  # [in, out] -> [out, in]
    if fc == "fc1":  # interleaved gate/up -> [gate; up]
        tensor = torch.cat([tensor[0::2], tensor[1::2]])
    return tensor.contiguous()


def _read(ckpt: Any, name: str, e: int) -> torch.Tensor:
    if name not in ckpt:
        raise ValueError(f"gpt_oss: the checkpoint lacks {name!r}")
    return ckpt.read(name, (slice(e, e + 1),))[0]


def _read_weight(ckpt: Any, name: str, e: int) -> torch.Tensor:
    """``name[e]`` ``[in, out]``: stored, or dequantized from MXFP4 blocks and scales."""
    if name in ckpt or f"{name}_blocks" not in ckpt:
        return _read(ckpt, name, e)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = ckpt.read(f"{name}_blocks", (slice(e, e + 1),))
    scales = ckpt.read(f"{name}_scales", (slice(e, e + 1),))
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)[0]


def peft_experts(
    module: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The experts' LoRA as PEFT's parameter wrappers of ``gate_up_proj`` (inner) and
    ``down_proj`` (outer; both written, zero where not adapted, so every layer nests them
    alike): A ``[E * r, in]`` expert-major, B ``[out, r * E]`` rank-major, fc1's B rows
    interleaved as gate_up_proj's columns."""
    if "fc1" not in pairs:  # zeros of fc1's shapes: A [E, r, H], B [E, 2I, r]
        a, b = pairs["fc2"]
        pairs = {
            **pairs,
            "fc1": (
                a.new_zeros(*a.shape[:2], b.size(1)),
                b.new_zeros(b.size(0), 2 * a.size(2), b.size(2)),
            ),
        }
    if "fc2" not in pairs:  # A [E, r, I], B [E, H, r]
        a, b = pairs["fc1"]
        pairs = {
            **pairs,
            "fc2": (
                a.new_zeros(*a.shape[:2], b.size(1) // 2),
                b.new_zeros(b.size(0), a.size(2), b.size(2)),
            ),
        }
    tensors = {}
    for fc, key in (("fc1", f"{module}.base_layer"), ("fc2", module)):
        a, b = pairs[fc]
        if fc == "fc1":  # [gate; up] rows -> interleaved
            gate, up = b.chunk(2, dim=1)
            b = torch.stack([gate, up], dim=2).flatten(1, 2)
        tensors[f"{key}.lora_A.weight"] = a.flatten(0, 1).clone()
        tensors[f"{key}.lora_B.weight"] = b.permute(1, 2, 0).flatten(1, 2).clone()
    return tensors, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def peft_experts_in(
    tensors: dict[str, torch.Tensor], module: str, fc: str, experts: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`peft_experts` undone for one linear (taking its tensors out of ``tensors``):
    A ``[E, r, in]``, B ``[E, out, r]`` in megatron's rows; None where the adapter has none."""
    key = f"{module}.base_layer" if fc == "fc1" else module
    if f"{key}.lora_A.weight" not in tensors:
        return None
    a = tensors.pop(f"{key}.lora_A.weight")
    b = tensors.pop(f"{key}.lora_B.weight")
    a = a.view(experts, -1, a.size(1))
    b = b.view(b.size(0), -1, experts).permute(2, 0, 1)  # [E, out, r]
    if fc == "fc1":  # interleaved -> [gate; up]
        b = torch.cat([b[:, 0::2], b[:, 1::2]], dim=1)
    return a.contiguous(), b.contiguous()


FAMILY = Family(
    "gpt_oss",
    moe=True,
    renormalise_topk=True,
    qkv_bias_flag="attention_bias",
    window_layers=functools.partial(named_layer_types, rule=_alternating),
    finish=_finish,
    layer_tensors={
        "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
        "self_attention.core_attention.softmax_offset": "self_attn.sinks",
    },
    router="router",
    expert_tensor=expert_tensor,
    peft_experts=peft_experts,
    peft_experts_in=peft_experts_in,
)

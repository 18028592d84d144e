"""What a model family declares: how its Hugging Face ``config.json`` maps onto
:class:`~megatron_multilora.models.gpt_config.GPTModelConfig`, the names of its tensors and
the PEFT names of its adapted linears. Generic code (``hf_config``, ``hf_import``,
``checkpoint/peft_format``) reads a :class:`Family` and tests no ``model_type`` itself; the
defaults are Llama's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, Protocol

from megatron_multilora.models.gpt_config import GPTModelConfig


class Fields(Protocol):
    """How ``hf_config`` reads a ``config.json`` (``d``: the dict); errors name the model
    type and the field."""

    d: dict
    model_type: str

    def get(self, name: str, default: Any = None) -> Any: ...

    def require(self, name: str) -> Any: ...

    def reject(self, name: str, value: Any, why: str) -> NoReturn: ...


def _no(hf: Fields) -> bool:
    return False


def _nothing(*args: Any) -> None:
    return None


def named_layer_types(hf: Fields, rule: Callable[[Fields], list[str]]) -> list[str]:
    """config.json's ``layer_types``, or ``rule``'s for files that predate them."""
    types = hf.get("layer_types")
    return list(types) if types is not None else rule(hf)


@dataclasses.dataclass(frozen=True)
class Family:
    """One ``model_type``: Llama's mapping unless a field says otherwise."""

    model_type: str
    # -- config.json -> GPTModelConfig -----------------------------------------------------
    config: Callable[[Fields], GPTModelConfig] | None = None  # a mapping of its own (MLA)
    moe: bool = False  # every layer an MoE layer (experts, router; shared experts below)
    qkv_bias: Callable[[Fields], bool] = _no
    qk_norm: str | None = None  # "per_head" (Qwen3's q_norm/k_norm) or "across_heads" (OLMoE)
    partial_rotary: bool = False  # RoPE may rotate only partial_rotary_factor of a head
    rotary_share: float = 1.0  # partial_rotary_factor where config.json leaves it out
    # a config.json flag of biases this family maps: q/k/v ones here (and any others in its
    # finish: gpt-oss's o_proj), instead of refusing it as Llama's attention_bias
    qkv_bias_flag: str | None = None
    window_always: bool = False  # sliding_window applies whenever set (no use_sliding_window)
    # Its layers differ: their layer_types (config.json's, or its rule for files that predate
    # them: see named_layer_types); None: every layer has the window, if any.
    window_layers: Callable[[Fields], list[str]] | None = None
    rope: Callable[[Fields], dict[str, Any]] | None = None  # RoPE fields of its own
    silu_only: bool = True  # hidden_act must be silu (a family with another checks its own)
    check: Callable[[Fields], None] = _nothing  # its refusals of fields it does not reproduce
    finish: Callable[[Fields, GPTModelConfig], None] = _nothing  # the rest of its config
    renormalise_topk: bool | None = None  # None: as norm_topk_prob says
    expert_width: str = "intermediate_size"  # the config.json field of an expert's width
    shared_expert_gate: bool = False  # shared_expert_intermediate_size, with a sigmoid gate
    # A multimodal checkpoint's language model: the config.json section it is described in,
    # and the module holding its embed_tokens, layers and norm (in tensor and PEFT names;
    # its tensors are read as a causal LM's "model.").
    text_config: str | None = None
    language_model: str = "model"
    # -- tensors (below model.layers.{i}.) ---------------------------------------------------
    layer_tensors: Mapping[str, str] = dataclasses.field(default_factory=dict)  # beyond Llama's
    unit_offset_norms: tuple[str, ...] = ()  # parameters (suffixes) holding (1 + w) norms
    moe_block: str = "mlp"  # the MoE block's module
    expert_linears: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_experts: str = "shared_expert"  # the shared expert(s)' module below the MoE block
    router: str = "gate"  # the router's module below the MoE block
    # An expert's megatron fc1 ([gate; up] rows) or fc2 tensor ("weight" [out, in], "bias")
    # from its own checkpoint layout: (checkpoint, "<moe block>.experts", expert, "fc1" or
    # "fc2", "weight" or "bias"); None: per-expert linears or transformers' fused ones.
    expert_tensor: Callable[[Any, str, int, str, str], Any] | None = None
    skipped: Callable[[str, int], bool] = lambda name, num_layers: False  # tensors not loaded
    # Experts as PEFT target_parameters (gpt-oss: fused parameters, no per-expert modules):
    # (the layer's experts module, {"fc1"/"fc2": (A [E, r, in], B [E, out, r])}, megatron's
    # rows) -> (PEFT tensors by key, "<module>.<parameter>" targets); None: per-expert modules.
    peft_experts: Callable[[str, dict[str, tuple[Any, Any]]], tuple[dict, list[str]]] | None = None
    # ... and back: (PEFT tensors, the experts module, "fc1"/"fc2", experts) -> (A, B) or None
    peft_experts_in: Callable[[dict, str, str, int], tuple[Any, Any] | None] | None = None
    # -- linears megatron fuses: the HF module(s) each is -------------------------------------
    fused_modules: Mapping[str, str] = dataclasses.field(default_factory=dict)  # kept fused
    own_modules: Mapping[str, str] = dataclasses.field(default_factory=dict)  # one to one

"""megatron-multilora: train many LoRA adapters at once on one frozen Megatron-core model."""

from megatron_multilora.platform.cpu_support import quiet_missing_accelerator_warnings

quiet_missing_accelerator_warnings()  # before megatron is imported below

from megatron_multilora.layers.expert_lora import MultiLoRAGroupedExpertLinear
from megatron_multilora.layers.inject import apply_multi_lora, set_adapter_trainability
from megatron_multilora.layers.lifecycle import (
    adapter_state_dict,
    clear_adapter_slot,
    expose_adapter_slot,
    hide_adapters,
    init_adapter_slot,
    load_adapter,
    multi_lora_modules,
    set_tokens_per_adapter_slot,
    slot_parameters,
)
from megatron_multilora.layers.multi_lora_linear import LoRASlot, MultiLoRALinear
from megatron_multilora.layers.slot_routing import ExpertSlotRouting, install_moe_slot_routing
from megatron_multilora.layers.slot_tensors import get_slot_tensors, set_slot_tensors
from megatron_multilora.models.gpt import GPTModelConfig, build_gpt_model
from megatron_multilora.parallel import destroy_parallel, init_parallel

__all__ = [
    "ExpertSlotRouting",
    "GPTModelConfig",
    "LoRASlot",
    "MultiLoRAGroupedExpertLinear",
    "MultiLoRALinear",
    "adapter_state_dict",
    "apply_multi_lora",
    "build_gpt_model",
    "clear_adapter_slot",
    "destroy_parallel",
    "expose_adapter_slot",
    "get_slot_tensors",
    "hide_adapters",
    "init_adapter_slot",
    "init_parallel",
    "install_moe_slot_routing",
    "load_adapter",
    "multi_lora_modules",
    "set_adapter_trainability",
    "set_slot_tensors",
    "set_tokens_per_adapter_slot",
    "slot_parameters",
]

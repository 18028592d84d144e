"""megatron-multilora: train many LoRA adapters at once on one frozen Megatron-core model."""

import importlib

from megatron_multilora.platform import quiet_missing_accelerator_warnings

quiet_missing_accelerator_warnings()  # before megatron is first imported

# Public names -> their modules, imported on first use (PEP 562): importing megatron takes
# seconds, and light users (config checks, scripts) must not pay for it.
_EXPORTS = {
    "MultiLoRAGroupedExpertLinear": "layers.expert_lora",
    "apply_multi_lora": "layers.inject",
    "set_adapter_trainability": "layers.inject",
    "adapter_state_dict": "layers.lifecycle",
    "clear_adapter_slot": "layers.lifecycle",
    "expose_adapter_slot": "layers.lifecycle",
    "hide_adapters": "layers.lifecycle",
    "init_adapter_slot": "layers.lifecycle",
    "load_adapter": "layers.lifecycle",
    "multi_lora_modules": "layers.lifecycle",
    "set_tokens_per_adapter_slot": "layers.lifecycle",
    "slot_parameters": "layers.lifecycle",
    "LoRASlot": "layers.slot_bank",
    "MultiLoRALinear": "layers.multi_lora_linear",
    "get_slot_tensors": "layers.slot_tensors",
    "set_slot_tensors": "layers.slot_tensors",
    "GPTModelConfig": "models.gpt_config",
    "build_gpt_model": "models.gpt",
    "destroy_parallel": "parallel",
    "init_parallel": "parallel",
    "support_megatron_here": "platform",
    "ExpertSlotRouting": "layers.slot_routing",
    "install_moe_slot_routing": "layers.slot_routing",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


__all__ = sorted(_EXPORTS)

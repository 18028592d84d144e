"""Model building: configs, layer specs and the Megatron GPT builder."""

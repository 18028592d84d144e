"""Phi-3 (``phi3``): partial rotary, a sliding window whenever set, and q/k/v and gate/up kept
fused in one module each (``qkv_proj`` rows ``[q; k; v]``, ``gate_up_proj`` rows
``[gate; up]``), in its checkpoints and in its PEFT adapters."""

from megatron_multilora.models.families.family import Family

FAMILY = Family(
    "phi3",
    partial_rotary=True,
    window_always=True,
    fused_modules={
        "self_attention.linear_qkv": "self_attn.qkv_proj",
        "mlp.linear_fc1": "mlp.gate_up_proj",
    },
)

"""OLMoE (``olmoe``): every layer MoE (experts as wide as ``intermediate_size``), q/k norms
over the whole projection."""

from megatron_multilora.models.families.family import Family

FAMILY = Family("olmoe", moe=True, qk_norm="across_heads")

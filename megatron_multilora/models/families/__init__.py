"""The model families, one module each (:class:`~.family.Family`): the one place a Hugging
Face ``model_type`` is named. A new family is its module and a line here."""

from __future__ import annotations

from megatron_multilora.models.families import (
    deepseek_v3,
    gemma3_text,
    glm4_moe,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    olmoe,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_moe,
    smollm3,
)
from megatron_multilora.models.families.family import Family, Fields

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        llama.FAMILY,
        mistral.FAMILY,
        phi3.FAMILY,
        qwen2.FAMILY,
        qwen3.FAMILY,
        mixtral.FAMILY,
        qwen3_moe.FAMILY,
        olmoe.FAMILY,
        qwen2_moe.FAMILY,
        deepseek_v3.FAMILY,
        gemma3_text.FAMILY,
        smollm3.FAMILY,
        glm4_moe.FAMILY,
        gpt_oss.FAMILY,
        qwen3_5.FAMILY,
        qwen3_5.MOE_FAMILY,
        qwen3_5.MULTIMODAL_FAMILY,
        qwen3_5.MULTIMODAL_MOE_FAMILY,
    )
}


def family_of(model_type: str | None) -> Family:
    """The family of ``model_type``; ``ValueError`` naming the supported ones otherwise."""
    if model_type not in FAMILIES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]


__all__ = ["FAMILIES", "Family", "Fields", "family_of"]

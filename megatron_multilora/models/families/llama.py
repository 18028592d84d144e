"""Llama (``llama``; Llama 3.x RoPE scaling too): the mapping every family starts from."""

from megatron_multilora.models.families.family import Family

FAMILY = Family("llama")

"""Mistral (``mistral``): Llama with a sliding window whenever ``sliding_window`` is set."""

from megatron_multilora.models.families.family import Family

FAMILY = Family("mistral", window_always=True)

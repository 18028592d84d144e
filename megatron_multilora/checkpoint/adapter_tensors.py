"""The checkpoint code's names for one slot's full, layout-independent tensors; the logic
lives with the layers (:mod:`megatron_multilora.layers.slot_tensors`)."""

from megatron_multilora.layers.slot_tensors import (  # noqa: F401
    get_slot_tensors as gather_slot,
    set_slot_tensors as load_slot,
    slot_rank_alpha,
)

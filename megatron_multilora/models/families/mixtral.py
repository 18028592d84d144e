"""Mixtral (``mixtral``): every layer MoE under ``block_sparse_moe`` with experts ``w1``
(gate), ``w3`` (up), ``w2`` (down); the top-k always renormalised; a sliding window
whenever set."""

from megatron_multilora.models.families.family import Family, Fields


def _check(hf: Fields) -> None:
    if hf.get("router_jitter_noise", 0.0):
        hf.reject(
            "router_jitter_noise",
            hf.d["router_jitter_noise"],
            "router noise changes training-mode routing",
        )


FAMILY = Family(
    "mixtral",
    moe=True,
    window_always=True,
    renormalise_topk=True,
    check=_check,
    moe_block="block_sparse_moe",
    expert_linears=("w1", "w3", "w2"),
)

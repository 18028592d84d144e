"""Targets under the names PEFT users write, and adapting only some parts of a fused linear.

Megatron fuses what Hugging Face keeps apart (q/k/v in ``linear_qkv``, gate/up in a gated
``linear_fc1``), so ``target_modules=["q_proj", "v_proj"]`` wraps ``linear_qkv`` with only
its q and v rows adapted. ``linear_qkv`` and ``linear_proj`` (default targets) also name
multi-latent attention's input projections and a Gated DeltaNet's ``in_proj`` and
``out_proj``, so the defaults adapt every family's attention. The other rows of every slot's B are zero and the LoRA term's
rows there are masked out, so they add nothing and get no gradient: B stays zero there
under any optimizer, as if k_proj were not wrapped (and export leaves it out).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_multilora.ops.fused_rows import DeltaNetRows, QKVRows
from megatron_multilora.validation import DELTA_NET_LINEARS, MLA_INPUT_PROJECTIONS, PEFT_TARGETS

# The parts of each fused linear, in its row order.
FUSED_PARTS = {
    "linear_qkv": ("q", "k", "v"),
    "linear_fc1": ("gate", "up"),
    "in_proj": DeltaNetRows.PARTS,  # a Gated DeltaNet's
}


class Targets:
    """``target_modules`` as megatron linears: ``names`` to match (module names or wildcard
    patterns), ``parts[name]`` the parts of a fused linear to adapt where not all, and
    ``asked[name]`` the targets as written that it stands for (for errors)."""

    def __init__(self, targets: Sequence[str]) -> None:
        self.names: list[str] = []
        self.asked: dict[str, list[str]] = {}
        wanted: dict[str, set[str]] = {}
        for target in targets:
            for linear, part in _linears(target):
                if linear not in self.names:
                    self.names.append(linear)
                self.asked.setdefault(linear, []).append(target)
                every = FUSED_PARTS.get(linear, ())
                wanted.setdefault(linear, set()).update(every if part is None else {part})
        self.parts = {
            name: frozenset(parts)
            for name, parts in wanted.items()
            if name in FUSED_PARTS and set(FUSED_PARTS[name]) - parts
        }

    def unmatched(self, matched: set[str]) -> set[str]:
        """The targets as written none of whose linears matched."""
        hit = {t for name in matched for t in self.asked[name]}
        return {t for ts in self.asked.values() for t in ts} - hit


def _linears(target: str) -> tuple[tuple[str, str | None], ...]:
    """The (linear, part) pairs a target stands for; ``linear_qkv`` is multi-latent
    attention's input projections and a Gated DeltaNet's ``in_proj`` too, ``linear_proj`` its
    ``out_proj``."""
    if target == "linear_qkv":
        inputs = (*MLA_INPUT_PROJECTIONS, DELTA_NET_LINEARS[0])
        return (("linear_qkv", None), *((name, None) for name in inputs))
    if target == "linear_proj":
        return ("linear_proj", None), (DELTA_NET_LINEARS[1], None)
    return PEFT_TARGETS.get(target, ((target, None),))


def kept_rows(linear: str, parts: frozenset[str], rows: int, config: object) -> torch.Tensor:
    """Which of a fused linear's ``rows`` output rows (this rank's) belong to ``parts``.

    ``linear_qkv`` rows are whole query groups (q heads and their output gates, k, v;
    :class:`QKVRows`) on every tensor-parallel rank, a Gated DeltaNet's ``in_proj`` rows whole
    key heads (:class:`DeltaNetRows`); a gated fc1's are ``[gate_r; up_r]``."""
    if linear == "in_proj":
        return DeltaNetRows.of(config).kept(parts, rows)
    if linear == "linear_qkv":
        layout = QKVRows.of(config)
        d = layout.head_dim
        sizes = {"q": layout.q_rows_per_group, "k": d, "v": d}
        group = torch.cat([torch.full((sizes[p],), p in parts) for p in FUSED_PARTS[linear]])
        return group.repeat(rows // group.numel())
    half = rows // 2
    return torch.cat([torch.full((half,), "gate" in parts), torch.full((half,), "up" in parts)])

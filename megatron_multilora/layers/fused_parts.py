"""Targets under the names PEFT users write, and adapting only some parts of a fused linear.

Megatron fuses what Hugging Face keeps apart (q/k/v in ``linear_qkv``, gate/up in a gated
``linear_fc1``), so ``target_modules=["q_proj", "v_proj"]`` wraps ``linear_qkv`` with only
its q and v rows adapted. ``linear_qkv`` (a default target) also names multi-latent
attention's input projections, so the defaults adapt every family's attention. The other rows of every slot's B are zero and the LoRA term's
rows there are masked out, so they add nothing and get no gradient: B stays zero there
under any optimizer, as if k_proj were not wrapped (and export leaves it out).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_multilora.ops.fused_rows import QKVRows
from megatron_multilora.validation import MLA_INPUT_PROJECTIONS, PEFT_TARGETS

# The parts of each fused linear, in its row order.
FUSED_PARTS = {"linear_qkv": ("q", "k", "v"), "linear_fc1": ("gate", "up")}


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
    attention's input projections too."""
    if target == "linear_qkv":
        return (("linear_qkv", None), *((name, None) for name in MLA_INPUT_PROJECTIONS))
    return PEFT_TARGETS.get(target, ((target, None),))


def kept_rows(linear: str, parts: frozenset[str], rows: int, config: object) -> torch.Tensor:
    """Which of a fused linear's ``rows`` output rows (this rank's) belong to ``parts``.

    ``linear_qkv`` rows are whole query groups (q heads, k, v; :class:`QKVRows`) on every
    tensor-parallel rank; a gated fc1's are ``[gate_r; up_r]``."""
    if linear == "linear_qkv":
        layout = QKVRows.of(config)
        d = layout.head_dim
        sizes = {"q": layout.q_per_group * d, "k": d, "v": d}
        group = torch.cat([torch.full((sizes[p],), p in parts) for p in FUSED_PARTS[linear]])
        return group.repeat(rows // group.numel())
    half = rows // 2
    return torch.cat([torch.full((half,), "gate" in parts), torch.full((half,), "up" in parts)])

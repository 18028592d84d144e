"""Multi-latent attention (DeepSeek-V3's MLA) settings of a :class:`GPTModelConfig`.

Torch-free like :mod:`.gpt_config`; :mod:`.gpt` turns them into megatron's
``MLATransformerConfig`` fields.
"""

from __future__ import annotations

import dataclasses

from megatron_multilora.validation import at_least, positive, ranged


@dataclasses.dataclass
class MLAConfig:
    """The low-rank q and kv projections and the split of each head into a part without and
    a part with RoPE (megatron's names; DeepSeek-V3's in brackets)."""

    q_lora_rank: int | None = ranged(None, at_least(1, optional=True))
    """Width of the q down-projection [q_lora_rank]; None: one q projection, no down-projection."""
    kv_lora_rank: int = ranged(512, at_least(1))
    """Width of the compressed kv latent [kv_lora_rank]."""
    qk_head_dim: int = ranged(128, at_least(1))
    """q/k channels per head without RoPE [qk_nope_head_dim]."""
    qk_pos_emb_head_dim: int = ranged(64, at_least(2))
    """q/k channels per head with RoPE, one k part shared by all heads [qk_rope_head_dim]."""
    v_head_dim: int = ranged(128, at_least(1))
    """Value channels per head [v_head_dim]."""
    rope_type: str = "rope"
    """rope, or yarn (the fields below; they also scale the softmax)."""
    rotary_scaling_factor: float = ranged(1.0, at_least(1.0))
    original_max_position_embeddings: int = ranged(4096, at_least(1))
    beta_fast: float = ranged(32.0, positive())
    beta_slow: float = ranged(1.0, positive())
    mscale: float = ranged(1.0, positive())
    mscale_all_dim: float = ranged(0.0, at_least(0.0))

    def check(self) -> list[str]:
        """Problems of the settings themselves (the layout's: ``models/mla_spec.py``)."""
        problems = []
        if self.rope_type not in ("rope", "yarn"):
            problems.append(f"mla.rope_type={self.rope_type!r}: choose one of ('rope', 'yarn')")
        if self.qk_pos_emb_head_dim % 2:
            problems.append(f"mla.qk_pos_emb_head_dim={self.qk_pos_emb_head_dim} must be even")
        return problems

    def megatron_fields(self, rotary_base: float) -> dict:
        """``MLATransformerConfig`` fields (besides those of every GPT)."""
        return dict(
            multi_latent_attention=True,
            **dataclasses.asdict(self),
            rotary_base=rotary_base,
            # megatron's fused MLA RoPE is a GPU kernel, and the plain fused RoPE skips
            # MLA's de-interleaving of the rotated channels: the unfused path does both.
            apply_rope_fusion=False,
        )


def mla_layout_problems(tp: int, sequence_parallel: bool) -> list[str]:
    """What keeps megatron's MLA from training correctly on the layout."""
    if tp > 1 and not sequence_parallel:
        return [
            f"multi-latent attention at tensor parallel size {tp} needs sequence parallelism: "
            "without it megatron-core 0.16.1 does not sum the shared RoPE key's gradient over "
            "the TP ranks' heads (wrong gradients); set sequence parallelism (parallel.sp=true)"
        ]
    return []

"""Rotary position embedding (RoPE, Su et al. 2021) as one elementwise autograd op.

For a head vector ``x`` at position ``p`` of its sequence, with ``f = freqs[p]`` (the angles,
``[theta_0..theta_{d/2-1}]`` repeated twice, megatron's non-interleaved layout)::

    rope(x) = x * cos(f) + rotate_half(x) * sin(f),   rotate_half([x1, x2]) = [-x2, x1]

and, since ``rotate_half`` is a rotation by 90 degrees (its transpose is its negative), the
input gradient is ``g * cos(f) - rotate_half(g * sin(f))``.

These are megatron's ``fused_apply_rotary_pos_emb(_thd)`` entry points (normally Transformer
Engine's kernels, chosen by ``apply_rope_fusion``), in torch for where TE is absent. Megatron's
unfused packed path cuts the micro-batch into its sequences on every call (a host read of
their lengths: a device sync on a GPU) and computes cos and sin again in every layer; here a
packed micro-batch's cos and sin are gathered once per position and shared by every layer.
"""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Rotate(torch.autograd.Function):
    """``x * cos + rotate_half(x) * sin`` with its backward written out: one autograd node
    instead of the eight of the composed ops."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        cos: torch.Tensor,  # type: ignore[override]
        sin: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return x * cos + _rotate_half(x) * sin

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return grad * cos - _rotate_half(grad * sin), None, None


def _apply(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.size(-1)`` channels of ``t``; the rest (partial rotary) pass."""
    rot = cos.size(-1)
    if rot == t.size(-1):
        return _Rotate.apply(t, cos, sin)
    return torch.cat((_Rotate.apply(t[..., :rot], cos, sin), t[..., rot:]), dim=-1)


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """``t`` ``[s, b, heads, d]`` rotated by ``freqs`` ``[s, 1 or b, 1, rot_dim]`` (megatron's
    ``fused_apply_rotary_pos_emb``)."""
    if interleaved:
        raise ValueError(
            "interleaved rotary embeddings are not implemented without Transformer "
            "Engine; set rotary_interleaved=False"
        )
    return _apply(t, freqs.cos().to(t.dtype), freqs.sin().to(t.dtype))


def apply_rope_packed(
    t: torch.Tensor,
    cu_seqlens: torch.Tensor,
    freqs: torch.Tensor,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> torch.Tensor:
    """``t`` ``[tokens, heads, d]`` of packed sequences (bounds ``cu_seqlens``), each rotated
    from position 0 of its own sequence by ``freqs`` ``[max_seqlen, 1, 1, rot_dim]``
    (megatron's ``fused_apply_rotary_pos_emb_thd``)."""
    if cp_size != 1:
        raise ValueError(
            f"packed rotary embeddings over {cp_size} context-parallel ranks are not "
            "implemented without Transformer Engine; use context_parallel_size=1"
        )
    cos, sin = _packed_cos_sin(cu_seqlens, freqs, t.size(0), t.dtype)
    return _apply(t, cos, sin)


def _packed_cos_sin(
    cu_seqlens: torch.Tensor, freqs: torch.Tensor, tokens: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each packed token's angles, ``[tokens, 1, rot_dim]``. Every layer of a
    micro-batch passes the same ``cu_seqlens`` and ``freqs`` objects, so they are computed
    by the first and kept on ``cu_seqlens`` (a micro-batch's own tensor) for the rest, one
    entry per table (Gemma 3's local and global layers have one each)."""
    cached = getattr(cu_seqlens, "_rope_cos_sin", ())
    for table, cos, sin in cached:
        if table is freqs and cos.dtype == dtype:
            return cos, sin
    starts, lengths = cu_seqlens[:-1].long(), cu_seqlens.diff().long()
    # Each token's position in its sequence, without reading the lengths on the host.
    positions = torch.arange(tokens, device=cu_seqlens.device) - starts.repeat_interleave(
        lengths, output_size=tokens
    )
    angles = freqs.flatten(1)  # [max_seqlen, rot_dim]: cos/sin of the table, then each token's row
    cos, sin = (f(angles)[positions].unsqueeze(1).to(dtype) for f in (torch.cos, torch.sin))
    cu_seqlens._rope_cos_sin = (*cached, (freqs, cos, sin))
    return cos, sin

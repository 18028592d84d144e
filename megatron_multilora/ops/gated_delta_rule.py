"""The gated delta rule (Yang et al. 2024, "Gated Delta Networks"), the linear attention of
Qwen3.5's Gated DeltaNet layers, in plain torch: chunked for whole sequences, one step at a
time for decoding.

Per head, with a state ``S`` of ``[d_k, d_v]`` (zero at a sequence's start), each position t
with an L2-normalised key ``k_t``, a query ``q_t`` (L2-normalised, times ``d_k ** -0.5``), a
value ``v_t``, a log decay ``g_t <= 0`` and a write strength ``beta_t`` does::

    S <- exp(g_t) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t

Chunked, a chunk of C positions with in-chunk cumulative decays ``G`` (``G_i = g_1 + .. +
g_i``) and ``D_ij = exp(G_i - G_j)`` (``i >= j``) solves the C coupled updates at once: with
``T = (I + strictly_lower((beta K) K^T * D))^-1``, the chunk writes ``U = T (beta V) - T
(beta K * exp(G)) S`` and reads ``O = (Q * exp(G)) S + lower((Q K^T) * D) U``; the state
leaves as ``exp(G_C) S + (K * exp(G_C - G))^T U``. This is the computation of
transformers' ``torch_chunk_gated_delta_rule`` (its CPU fallback, with the same chunk of 64):
the tests compare the two.

Tensors are ``[batch, positions, heads, dim]`` (``g``, ``beta``: ``[batch, positions,
heads]``), the value heads' count; states ``[batch, heads, d_k, d_v]``. Sequences of a batch
shorter than others are right-padded with zeros, which leave a state as it was (g = 0, beta
= 0), so a padded sequence's last state is its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2_normalised(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dim (flash-linear-attention's and
    transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _heads_first(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """[b, t, h, ...] -> fp32 [b, h, t, ...]."""
    return [t.transpose(1, 2).to(torch.float32).contiguous() for t in tensors]


def _prepare(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = l2_normalised(k)
    return l2_normalised(q) * q.size(-1) ** -0.5, k


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs ``[b, t, h, d_v]`` (in ``v``'s dtype) and the final states ``[b, h, d_k,
    d_v]`` (fp32) of whole sequences, from ``state`` (None: zeros). q and k are raw: they
    are normalised here, in fp32."""
    dtype, (b, t, h, dv) = v.dtype, v.shape
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    q, k = _prepare(q, k)
    pad = -t % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.size(-1)) for x in (q, k, v))
    g, beta = (x.reshape(b, h, n, chunk) for x in (g, beta))

    decay = g.cumsum(-1)  # G, per chunk
    decayed = decay.exp()
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta[..., None]
    coupling = (k_beta @ k.transpose(-1, -2)) * pairwise  # its strict lower part is used
    writes = torch.linalg.solve_triangular(
        coupling, v * beta[..., None], upper=False, unitriangular=True
    )
    reads = torch.linalg.solve_triangular(
        coupling, k_beta * decayed[..., None], upper=False, unitriangular=True
    )
    local = (q @ k.transpose(-1, -2)) * pairwise
    q_decayed = q * decayed[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decayed[..., -1, None, None]  # from whole chunks' exp: see ops/lanes.py

    s = q.new_zeros(b, h, k.size(-1), dv) if state is None else state.to(torch.float32)
    out = torch.empty_like(writes)
    for i in range(n):
        u = writes[:, :, i] - reads[:, :, i] @ s
        out[:, :, i] = q_decayed[:, :, i] @ s + local[:, :, i] @ u
        s = s * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = out.reshape(b, h, n * chunk, dv)[:, :, :t]
    return out.transpose(1, 2).to(dtype).contiguous(), s


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule a position at a time from ``state`` (decoding: a few new positions);
    shapes and dtypes as :func:`chunk_gated_delta_rule`'s."""
    dtype, t = v.dtype, v.size(1)
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    q, k = _prepare(q, k)
    s = state.to(torch.float32)
    out = torch.empty_like(v)
    for i in range(t):
        s = s * g[:, :, i].exp()[..., None, None]
        kv = (s * k[:, :, i, :, None]).sum(-2)  # S^T k
        delta = (v[:, :, i] - kv) * beta[:, :, i, None]
        s = s + k[:, :, i, :, None] * delta[:, :, None, :]
        out[:, :, i] = (s * q[:, :, i, :, None]).sum(-2)
    return out.transpose(1, 2).to(dtype).contiguous(), s

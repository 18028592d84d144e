"""Attention sinks (megatron's ``softmax_type``, gpt-oss's ``sinks``): every path of
SDPAttention (unpacked, a window, per-length packed batches, the one pass, the KV cache's
decode step) equals transformers' gpt-oss eager attention, outputs and gradients, with
query groups; sinks of -inf give plain attention."""

import types

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from megatron_multilora.models.gpt import transformer_config
from megatron_multilora.models.torch_modules import SDPAttention, attend_in_one_pass
from tests.hf_models import packed
from tests.models import tiny_gpt

pytest.importorskip("transformers")
HEADS, GROUPS, DIM, TOL = 4, 2, 16, 1e-5


def attention(window: int | None = None, softmax_type: str = "learnable") -> SDPAttention:
    cfg = tiny_gpt(num_attention_heads=HEADS, num_query_groups=GROUPS, sliding_window=window)
    cfg.softmax_type = softmax_type
    module = SDPAttention(transformer_config(cfg), 1, AttnMaskType.causal, "self")
    if softmax_type == "learnable":
        with torch.no_grad():
            module.softmax_offset.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    return module


def reference(module: SDPAttention, q, k, v, window: int | None = None) -> torch.Tensor:
    """transformers' gpt-oss eager attention, ``[s, b, h, d]`` in and ``[s, b, h * d]`` out."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    s, b = q.size(0), q.size(1)
    i = torch.arange(s)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    mask = torch.zeros(s, s).masked_fill(~allowed, float("-inf"))
    hf = types.SimpleNamespace(
        num_key_value_groups=HEADS // GROUPS, sinks=module.softmax_offset, training=False
    )
    out, _ = eager_attention_forward(
        hf, *(t.permute(1, 2, 0, 3) for t in (q, k, v)), mask, DIM**-0.5
    )
    return out.transpose(0, 1).reshape(s, b, -1)


def inputs(s: int, b: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(s, b, HEADS, DIM), (s, b, GROUPS, DIM), (s, b, GROUPS, DIM)]
    return [torch.randn(shape, generator=gen).requires_grad_() for shape in shapes]


def grads(out: torch.Tensor, tensors) -> list[torch.Tensor]:
    return torch.autograd.grad(out.square().sum(), tensors)


@pytest.mark.parametrize("window", [None, 4])
def test_unpacked_outputs_and_gradients_equal_transformers(window):
    module = attention(window)
    q, k, v = inputs(12)
    got, want = module(q, k, v, None), reference(module, q, k, v, window)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    params = [q, k, v, module.softmax_offset]
    for g, w in zip(grads(got, params), grads(want, params)):
        torch.testing.assert_close(g, w, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("one_pass", [False, True], ids=["per_length", "one_pass"])
def test_packed_sequences_each_equal_their_own(one_pass):
    module, lengths = attention(window=5), [11, 3, 7]
    q, k, v = (t[:, 0] for t in inputs(sum(lengths), b=1))  # [t, heads, dim]
    params, _ = packed(lengths)
    if one_pass:
        attend_in_one_pass(params)
    got = module(q, k, v, None, packed_seq_params=params)
    want = torch.cat(
        [
            reference(module, *(t[a:b, None] for t in (q, k, v)), window=5)[:, 0]
            for a, b in zip(params.cu_seqlens_q[:-1].tolist(), params.cu_seqlens_q[1:].tolist())
        ]
    )
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_a_decode_step_equals_the_last_row_of_the_whole_sequence():
    module = attention(window=5)
    q, k, v = inputs(9)
    whole = reference(module, q, k, v, window=5)
    step = module(q[-1:], k, v, None, attn_mask_type=AttnMaskType.no_mask)
    torch.testing.assert_close(step[0], whole[-1], rtol=TOL, atol=TOL)


def test_sinks_of_minus_infinity_are_plain_attention_and_zero_sinks_are_off_by_one():
    q, k, v = inputs(10)
    plain = attention(softmax_type="vanilla")(q, k, v, None)
    module = attention()
    with torch.no_grad():
        module.softmax_offset.fill_(float("-inf"))
    torch.testing.assert_close(module(q, k, v, None), plain, rtol=TOL, atol=TOL)
    with torch.no_grad():
        module.softmax_offset.zero_()
    off_by_one = attention(softmax_type="off-by-one")(q, k, v, None)
    torch.testing.assert_close(module(q, k, v, None), off_by_one, rtol=0, atol=0)
    assert (off_by_one - plain).abs().max() > 1e-2

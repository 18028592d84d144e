"""Packed micro-batches: attention runs per example (megatron's thd format), so a packed
forward equals running each example on its own, examples cannot see each other, and an
example's attention has the same bits whatever is packed beside it."""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

import megatron_multilora as mm
from megatron_multilora.data.datasets import Example
from megatron_multilora.models.torch_modules import padded_length
from megatron_multilora.training.step.micro_batches import pack_micro_batches
from tests.models import tiny_gpt

CFG = tiny_gpt(
    gated_linear_unit=True,
)
# Lengths spread enough to make several length buckets, plus pads to a multiple of 8.
SLOTS = [[31, 6], [], [4, 18, 9, 2]]


@pytest.fixture
def model():
    torch.manual_seed(0)
    return mm.apply_multi_lora(
        mm.build_gpt_model(CFG), len(SLOTS), 8, 4.0, row_init_method="normal"
    )


def examples(gen: torch.Generator) -> list[list[Example]]:
    return [
        [
            Example(tuple(torch.randint(0, 64, (n + 1,), generator=gen).tolist()), (True,) * n)
            for n in lengths
        ]
        for lengths in SLOTS
    ]


def packed_loss(model, mb) -> torch.Tensor:
    mm.set_tokens_per_adapter_slot(model, mb.counts)
    return model(
        mb.tokens, mb.position_ids, None, labels=mb.labels, packed_seq_params=mb.packed_seq_params()
    )[0]


def test_packed_forward_and_backward_equal_each_example_alone(model):
    (mb,) = pack_micro_batches(examples(torch.Generator().manual_seed(0)), 1000, pad_multiple=8)
    assert len(set(mb.seq_lengths)) > 3 and sum(mb.seq_lengths) == mb.tokens.size(1)
    packed = packed_loss(model, mb)
    packed.sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    alone, start = [], 0
    slot_of = [s for s, c in enumerate(mb.counts) for _ in range(c)]
    for length in mb.seq_lengths:
        counts = [0] * len(SLOTS)
        counts[slot_of[start]] = length
        mm.set_tokens_per_adapter_slot(model, counts)
        span = slice(start, start + length)
        alone.append(
            model(mb.tokens[:, span], torch.arange(length)[None], None, labels=mb.labels[:, span])[
                0
            ]
        )  # plain causal attention
        start += length
    alone = torch.cat(alone)
    alone.sum().backward()
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        if name in want_grads:
            torch.testing.assert_close(p.grad, want_grads[name], rtol=1e-4, atol=1e-6)


def test_examples_cannot_see_each_other(model):
    batches = examples(torch.Generator().manual_seed(1))
    (mb,) = pack_micro_batches(batches, 1000)
    before = packed_loss(model, mb).detach()
    first = batches[0][0]
    batches[0][0] = Example(tuple((t + 7) % 64 for t in first.tokens), first.loss_mask)
    (changed,) = pack_micro_batches(batches, 1000)
    after = packed_loss(model, changed).detach()
    n = mb.seq_lengths[0]
    assert not torch.allclose(after[:n], before[:n])  # the edited example changed
    torch.testing.assert_close(after[n:], before[n:], rtol=0, atol=1e-6)  # no other did


def packed_attention(attention, lengths: list[int], qkv: list[torch.Tensor]) -> torch.Tensor:
    """``attention`` over the sequences ``qkv`` (each ``[3, length, heads, dim]``) packed."""
    ends = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=ends,
        cu_seqlens_kv=ends,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    q, k, v = torch.cat(qkv, dim=1)
    return attention(q, k, v, None, packed_seq_params=params)


def test_an_examples_attention_does_not_depend_on_the_examples_beside_it(model):
    attention = model.decoder.layers[0].self_attention.core_attention
    gen = torch.Generator().manual_seed(3)
    qkv = {n: torch.randn(3, n, 4, 8, generator=gen) for n in (9, 13, 11, 6, 10)}
    alone = packed_attention(attention, [9], [qkv[9]])
    # Beside longer and shorter examples, of its padded length and of others, first or not.
    for beside in ([13], [11, 6], [10]):
        for lengths in ([9, *beside], [*beside, 9]):
            out = packed_attention(attention, lengths, [qkv[n] for n in lengths])
            start = 0 if lengths[0] == 9 else sum(beside)
            assert torch.equal(out[start : start + 9], alone), lengths


def test_padded_lengths_depend_on_the_length_alone_and_stay_under_a_quarter_past_16():
    assert [padded_length(n) for n in (1, 4, 5, 9, 12, 13, 17, 33, 100, 129)] == [
        4,
        4,
        8,
        12,
        12,
        16,
        20,
        40,
        112,
        160,
    ]
    assert all(n <= padded_length(n) < n * 1.25 for n in range(17, 5000))


def test_the_attention_buckets_come_from_the_host_lengths_not_a_device_read():
    """On a GPU a read of ``cu_seqlens_q`` would wait for the device every micro-batch: the
    packed micro-batch's bounds travel as the host knows them, through the slot layout too."""
    from megatron_multilora.layers.slot_layout_route import with_slot_layout
    from megatron_multilora.models.torch_modules import packed_layout
    from megatron_multilora.ops import host_values
    from tests.host_reads import refuse_host_reads

    (mb,) = pack_micro_batches(examples(torch.Generator().manual_seed(2)), 1000, pad_multiple=8)
    params = with_slot_layout(mb.packed_seq_params(), mb.counts)
    with refuse_host_reads():
        layout = packed_layout(params, torch.device("cpu"))
        ids = mb.sequence_ids()
    assert int(layout.unpack.numel()) == sum(mb.seq_lengths)
    assert ids.tolist() == [i for i, n in enumerate(mb.seq_lengths) for _ in range(n)]
    assert host_values.on_device([1, 2], torch.int32, torch.device("cpu")).tolist() == [1, 2]

"""The slot layout travels with its micro-batch: forwards of A then B, then the backwards of A
then B (a pipeline schedule's order), give each micro-batch the losses and adapter gradients
it has alone, also when activation recompute re-runs layers during backward."""

import dataclasses

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

import megatron_multilora as mm
from megatron_multilora.data.datasets import Example
from megatron_multilora.layers.lifecycle import named_multi_lora_modules
from megatron_multilora.layers.slot_layout_route import SlotPackedSeqParams, with_slot_layout
from megatron_multilora.training.step.micro_batches import pack_micro_batches
from megatron_multilora.validation import TARGETS

N, DIM, VOCAB = 3, 4, 64
DENSE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48)
MOE = dict(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=4,
    ffn_hidden_size=12,
    num_moe_experts=4,
    moe_router_topk=2,
)


def build(arch: dict, recompute: str | None, modules: list[str] | None = None, targets=TARGETS):
    cfg = mm.GPTModelConfig(
        vocab_size=VOCAB, recompute_granularity=recompute, recompute_modules=modules, **arch
    )
    torch.manual_seed(0)
    model = mm.build_gpt_model(cfg)
    # Non-zero B: every factor of a slot with tokens gets a gradient.
    mm.apply_multi_lora(model, N, DIM, 1.0, row_init_method="normal", target_modules=targets)
    for i, rank in enumerate([4, 2, 3]):
        mm.init_adapter_slot(model, i, rank, 2.0 * rank)
    return model


def micro_batch(seed: int, lengths_per_slot: list[list[int]]):
    """One packed micro-batch of random examples (``lengths_per_slot[s]``: slot s's lengths)."""
    gen = torch.Generator().manual_seed(seed)
    examples = [
        [
            Example(tuple(torch.randint(1, VOCAB, (n,), generator=gen).tolist()), (True,) * (n - 1))
            for n in lengths
        ]
        for lengths in lengths_per_slot
    ]
    (mb,) = pack_micro_batches(examples, token_budget=1000)
    return mb


# A: slot 0 empty, 11 positions; B: slot 1 empty, 14 positions; C: A's length, other counts.
A = micro_batch(1, [[], [5, 4], [5]])
B = micro_batch(2, [[7, 3], [], [7]])
C = micro_batch(3, [[4], [6], [4]])


def forward(model, mb, params):
    token_loss = model(mb.tokens, mb.position_ids, None, labels=mb.labels, packed_seq_params=params)
    weights = torch.linspace(0.5, 1.5, token_loss.numel()).view_as(token_loss)  # position-dependent
    return (token_loss * weights).sum()


def grads(model) -> dict[str, torch.Tensor | None]:
    out = {
        n: None if p.grad is None else p.grad.clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    model.zero_grad(set_to_none=True)
    return out


def carrying(mb):
    """``mb``'s packed params carrying its slot layout, as the training step passes them."""
    return with_slot_layout(mb.packed_seq_params(), mb.slot_layout())


def alone(model, mb):
    model.zero_grad(set_to_none=True)
    loss = forward(model, mb, carrying(mb))
    loss.backward()
    return loss.detach(), grads(model)


def interleaved(model, first, second, params):
    """Forward first, forward second, backward first, backward second."""
    model.zero_grad(set_to_none=True)
    losses = [forward(model, mb, params(mb)) for mb in (first, second)]
    out = []
    for loss in losses:
        loss.backward()
        out.append((loss.detach(), grads(model)))
    return out


def assert_same(got, want):
    (loss, g), (want_loss, want_g) = got, want
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    assert g.keys() == want_g.keys()
    for name in g:
        assert (g[name] is None) == (want_g[name] is None), name
        if g[name] is not None:
            torch.testing.assert_close(g[name], want_g[name], rtol=0, atol=0, msg=name)


def count_forwards(model, path: str) -> list[int]:
    calls = [0]
    model.get_submodule(path).register_forward_pre_hook(
        lambda *_: calls.__setitem__(0, calls[0] + 1)
    )
    return calls


CASES = [
    pytest.param(DENSE, None, None, id="dense-no-recompute"),
    pytest.param(DENSE, "full", None, id="dense-full"),
    pytest.param(DENSE, "selective", ["mlp"], id="dense-selective-mlp"),
    pytest.param(MOE, None, None, id="moe-no-recompute"),
    pytest.param(MOE, "full", None, id="moe-full"),
    pytest.param(MOE, "selective", ["moe"], id="moe-selective-moe"),
]


@pytest.mark.parametrize("arch,recompute,modules", CASES)
def test_interleaved_micro_batches_match_each_alone(arch, recompute, modules):
    model = build(arch, recompute, modules)
    fc1 = "decoder.layers.1.mlp." + (
        "experts.linear_fc1" if "num_moe_experts" in arch else "linear_fc1"
    )
    want = [alone(model, mb) for mb in (A, B)]
    calls = count_forwards(model, fc1)
    got = interleaved(model, A, B, carrying)
    # Recompute really re-ran the adapted MLP during backward, after B's forward.
    assert calls[0] == (2 if recompute is None else 4)
    for g, w in zip(got, want):
        assert_same(g, w)
    # Each micro-batch's empty slot got no gradient, the others did.
    slot = "adapters.{}.linear_in.weight"
    qkv = "decoder.layers.0.self_attention.linear_qkv."
    assert want[0][1][qkv + slot.format(0)] is None and want[1][1][qkv + slot.format(1)] is None
    assert want[0][1][qkv + slot.format(1)].abs().sum() > 0


@pytest.mark.parametrize("arch,recompute,modules", [c for c in CASES if c.values[1] is not None])
def test_layout_set_on_the_model_goes_wrong_under_recompute(arch, recompute, modules):
    """The scenario is real: counts set once per forward on the model (the old way) are B's
    when A's layers re-run in backward: a token-count error when the lengths differ, and
    silently wrong gradients when they do not."""
    model = build(arch, recompute, modules)
    want = alone(model, A)

    def set_on_model(mb):
        mm.set_tokens_per_adapter_slot(model, mb.counts)
        plain = mb.packed_seq_params()
        assert type(plain) is PackedSeqParams  # carries no layout
        return plain

    with pytest.raises(ValueError, match="tokens_per_adapter"):
        interleaved(model, A, B, set_on_model)
    got, _ = interleaved(model, A, C, set_on_model)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # the forward was right
    assert any(
        (g is None) != (want[1][k] is None) or (g is not None and not torch.equal(g, want[1][k]))
        for k, g in got[1].items()
    )


def test_packed_params_carry_the_layout_and_are_checked_against_the_model():
    params = carrying(A)
    assert isinstance(params, SlotPackedSeqParams)
    assert params.slot_layout.counts == tuple(A.counts) == (0, 7, 4)
    assert dataclasses.replace(params, max_seqlen_q=99).slot_layout is params.slot_layout
    model = build(DENSE, None)
    wrong = with_slot_layout(params, [3, 9])
    with pytest.raises(ValueError, match="2 entries but the model has 3 adapter slots"):
        forward(model, A, wrong)
    with pytest.raises(ValueError, match="leaves out slots"):
        with_slot_layout(params, A.counts, ep_slots=[2])


def test_linears_outside_transformer_layers_take_the_layout_from_the_model_call():
    model = build(DENSE, None, targets=["linear_qkv", "output_layer"])
    mm.set_tokens_per_adapter_slot(model, C.counts)  # stale: another micro-batch's counts
    params = carrying(A)
    forward(model, A, params)
    for path, linear in named_multi_lora_modules(model):
        assert linear.slot_layout is params.slot_layout, path
    assert isinstance(model.output_layer, mm.MultiLoRALinear)

"""The objectives' losses on hand-made spans, the keyed sampler, and packing of pairs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_multilora.data.datasets import Example
from megatron_multilora.training.objectives.dpo import DPO
from megatron_multilora.training.objectives.grpo import GRPO
from megatron_multilora.training.objectives.per_token import PerTokenLoss
from megatron_multilora.training.objectives.rollouts import advantages
from megatron_multilora.training.objectives.sft import SFT
from megatron_multilora.training.objectives.token_losses import (
    cross_entropy,
    importance_sampling,
    kl_to_reference,
    ppo,
)
from megatron_multilora.training.step.micro_batches import pack_micro_batches
from megatron_multilora.training.step.sampling import KeyedSampler, RowSampling


def dpo_span(beta=0.5, loss_type="sigmoid", smoothing=0.0):
    """Two pairs, then two pad positions (a sequence of their own): sequences 0-1, 2-3, 4."""
    logprobs = torch.tensor([0.0, -1.0, -2.0, 0.0, -3.0, 0.0, -0.5, -0.5, 0.0, -4.0, 0.0, 0.0])
    ref = torch.tensor([0.0, -1.5, -1.0, 0.0, -2.0, 0.0, -1.0, -1.0, 0.0, -3.0, 0.0, 0.0])
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    sequence = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4])
    chosen = (sequence % 2 == 0).float() * (sequence < 4).float()
    loss, metrics = DPO(beta, loss_type, smoothing).span_loss(
        logprobs, mask, {"ref_logprobs": ref, "chosen": chosen}, sequence
    )
    # by hand: pair 1 chosen -3 vs ref -2.5, rejected -3 vs -2; pair 2 chosen -1 vs -2, rejected -4 vs -3
    return loss, metrics, [(-3 + 2.5) - (-3 + 2), (-1 + 2) - (-4 + 3)], [(-0.5, -1), (1, -1)]


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_dpo_sigmoid_by_hand_and_pads_are_no_pair(smoothing):
    loss, metrics, h, rewards = dpo_span(smoothing=smoothing)
    want = sum(
        -(1 - smoothing) * F.logsigmoid(torch.tensor(0.5 * x))
        - smoothing * F.logsigmoid(torch.tensor(-0.5 * x))
        for x in h
    )
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    chosen, rejected = (sum(0.5 * r[i] for r in rewards) for i in (0, 1))
    assert metrics.tolist() == pytest.approx([chosen, rejected, chosen - rejected, 2.0])  # sums


def test_dpo_ipo_uses_length_averaged_log_ratios():
    loss, _, _, _ = dpo_span(loss_type="ipo")
    h = [(-0.5 / 2) - (-1 / 1), (1 / 2) - (-1 / 1)]
    assert float(loss) == pytest.approx(sum((x - 1 / (2 * 0.5)) ** 2 for x in h), rel=1e-6)


def test_tinker_named_token_losses():
    lp, old, adv = torch.tensor([-1.0, -0.5]), torch.tensor([-1.2, -0.1]), torch.tensor([2.0, -1.0])
    assert cross_entropy(lp, torch.tensor([1.0, 0.5])).tolist() == [1.0, 0.25]
    ratio = torch.exp(lp - old)
    assert importance_sampling(lp, old, adv).tolist() == pytest.approx((-ratio * adv).tolist())
    clipped = ppo(lp, old, adv, 0.9, 1.1)
    # pessimistic: ratio 1.22 clipped to 1.1 (positive advantage), ratio 0.67 to 0.9 (negative)
    assert clipped.tolist() == pytest.approx([-1.1 * 2.0, 0.9], rel=1e-6)
    assert kl_to_reference(lp, lp).tolist() == [0.0, 0.0]
    assert (kl_to_reference(lp, old) > 0).all()


def test_grpo_weights_and_metrics():
    lp = torch.tensor([0.0, -1.0, -2.0])
    values = {
        "logprobs": torch.tensor([0.0, -1.0, -1.0]),
        "advantages": torch.tensor([0.0, 1.0, 1.0]),
        "weights": torch.tensor([0.0, 0.5, 0.5]),
        "ref_logprobs": torch.tensor([0.0, -1.0, -2.0]),
    }
    loss, metrics = GRPO(0.2, 0.2, 0.0).span_loss(
        lp, torch.tensor([0.0, 1.0, 1.0]), values, torch.zeros(3, dtype=torch.long)
    )
    # token 1: ratio 1 -> -1; token 2: ratio e^-1 (below 0.8, the clipped term is larger) -> -e^-1
    assert float(loss) == pytest.approx(0.5 * (-1 - math.exp(-1)), rel=1e-6)
    assert metrics.tolist() == pytest.approx([0.0, 0.5])  # half the weight clipped


def test_group_normalised_advantages():
    adv = advantages([1.0, 0.0, 0.5, 0.5, 2.0, 2.0], 2, scale=True)
    assert adv[0] == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-4)) and adv[2:4] == [0.0, 0.0]
    assert advantages([1.0, 0.0], 2, scale=False) == [0.5, -0.5]


def test_keyed_sampler_draws_per_row_not_per_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    # Rows with and without a nucleus in one batch draw as they do alone.
    rows = [RowSampling(f"k{i}", temperature=1.0, top_p=p) for i, p in enumerate((1.0, 0.5, 1.0))]
    for t in range(10):
        together = KeyedSampler(rows)(logits, [0, 1, 2], [t] * 3)
        for i in range(3):
            assert together[i] == KeyedSampler(rows)(logits[i : i + 1], [i], [t])[0]
    # Without a nucleus the draws follow the softmax.
    many = [int(KeyedSampler([RowSampling("y")])(logits[:1], [0], [t])) for t in range(3000)]
    freq = torch.bincount(torch.tensor(many), minlength=50).double() / len(many)
    assert (freq - logits[0].double().softmax(-1)).abs().max() < 0.03
    draws = [
        int(KeyedSampler([RowSampling("x", 1.0, 0.2)])(logits[:1], [0], [t])) for t in range(40)
    ]
    top = logits[0].softmax(-1).sort(descending=True)
    nucleus = set(top.indices[: int((top.values.cumsum(0) < 0.2).sum()) + 1].tolist())
    assert set(draws) <= nucleus
    cold = [
        int(KeyedSampler([RowSampling("x", 1e-4, 1.0)])(logits[:1], [0], [t])) for t in range(5)
    ]
    assert cold == [int(logits[0].argmax())] * 5
    # Temperature 0 is greedy, beside sampled rows and with a nucleus too; a tie goes to the
    # first token.
    tied = logits.clone()
    tied[2, 7] = tied[2, 9] = tied[2].max() + 1
    greedy = [RowSampling("g", 0.0), RowSampling("h", 1.0), RowSampling("n", 0.0, 0.5)]
    for t in range(5):
        got = KeyedSampler(greedy)(tied, [0, 1, 2], [t] * 3)
        assert int(got[0]) == int(tied[0].argmax()) and int(got[2]) == 7
        assert got[1] == KeyedSampler(greedy)(tied[1:2], [1], [t])[0]


def test_a_pair_stays_in_one_micro_batch():
    pair = (
        Example((1, 5, 6, 2), (False, True, True), units=1),
        Example((1, 5, 7, 2), (False, True, True), units=0),
    )
    single = Example((1, 9, 2), (False, True))
    mbs = pack_micro_batches([[single, pair, pair]], token_budget=8)
    assert [mb.seq_lengths for mb in mbs] == [[2, 3, 3], [3, 3]]  # 8 then 6 positions
    assert [mb.loss_units_per_slot().tolist() for mb in mbs] == [[2], [1]]
    with pytest.raises(ValueError, match="a preference pair packs both answers together"):
        pack_micro_batches([[pair]], token_budget=5)


@pytest.mark.parametrize(
    "objective",
    [DPO(0.5, "sigmoid", 0.0), GRPO(0.2, 0.2, 0.0), PerTokenLoss("ppo"), SFT()],
    ids=lambda o: o.name,
)
def test_a_filler_costs_nothing_but_keeps_its_backward(objective):
    """A loss-free filler (its pads counted to slot 0, no objective inputs) adds no loss and no
    metric to the slot it pads, whatever that slot's objective, yet its loss stays on the
    graph: its backward must run like its peers' (their collectives wait on it)."""
    from megatron_multilora.training.step.micro_batches import filler_micro_batch
    from megatron_multilora.training.step.schedule import objective_loss

    filler = filler_micro_batch(n_slots=2, pad_multiple=4, pad_id=0)
    token_loss = torch.rand(1, 4, requires_grad=True)
    total, tokens, data = objective_loss([objective, SFT()], [1.0, 1.0], filler, token_loss)
    assert total.requires_grad and float(total) == 0.0 and int(tokens) == 0
    assert not data["per_slot"].any()
    total.backward()
    assert not token_loss.grad.any()

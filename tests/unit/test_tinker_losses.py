"""Tinker's built-in losses as the service computes them (``PerTokenLoss`` on a packed span of
two datums) against plain PyTorch written from Tinker's documented formulas, one datum at a
time: the loss and its gradient with respect to the trained log-probs; and the on-policy
invariant (sampler = policy: every policy loss takes importance sampling's gradient)."""

from __future__ import annotations

import pytest
import torch

from megatron_multilora.training.objectives.grpo import GRPO
from megatron_multilora.training.objectives.per_token import PerTokenLoss
from megatron_multilora.training.objectives.token_losses import TOKEN_LOSSES

LENGTHS = (4, 5)  # two datums packed in one span


def reference(loss: str, lp, old, adv, ratio_mask, config) -> torch.Tensor:
    """One datum's loss, as Tinker's loss-functions documentation writes it."""
    lo, hi = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    ratio = torch.exp(lp - old)
    if loss == "importance_sampling":
        return -(ratio * adv).sum()
    if loss == "ppo":
        return -torch.min(ratio * adv, torch.clamp(ratio, lo, hi) * adv).sum()
    if loss == "cispo":
        return -(torch.clamp(ratio, lo, hi).detach() * lp * adv).sum()
    if loss == "dro":
        return -(lp * adv - 0.5 * config["beta"] * (lp - old) ** 2).sum()
    if loss == "gspo":
        log_ratio = (lp.detach() - old)[ratio_mask != 0].mean()
        seq_ratio = torch.exp(log_ratio + lp - lp.detach())
        return -torch.min(seq_ratio * adv, torch.clamp(seq_ratio, lo, hi) * adv).sum()
    if loss == "stable_reinforce":  # ours (Tinker publishes no formula): truncated IS weight
        return -(torch.clamp(ratio.detach(), max=hi) * lp * adv).sum()
    raise AssertionError(loss)


def batch(seed: int, on_policy: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    lp = -torch.rand(n, generator=gen) * 2
    old = lp.clone() if on_policy else lp + torch.randn(n, generator=gen) * 0.4
    return {
        "lp": lp,
        "old": old,
        "adv": torch.randn(n, generator=gen),
        "mask": (torch.rand(n, generator=gen) > 0.3).float(),
        "sequence": torch.cat([torch.full((k,), i) for i, k in enumerate(LENGTHS)]),
    }


CONFIGS = {
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3},
    "dro": {"beta": 0.3},
    "gspo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05},
    "stable_reinforce": {"clip_high_threshold": 1.5},
}


def ours_and_reference(loss: str, b: dict, config: dict):
    lp = b["lp"].clone().requires_grad_()
    values = {"logprobs": b["old"], "advantages": b["adv"], "sequence_ratio_mask": b["mask"]}
    got, _ = PerTokenLoss(loss, config).span_loss(lp, torch.ones_like(lp), values, b["sequence"])
    (got_grad,) = torch.autograd.grad(got, lp)
    ref_lp = b["lp"].clone().requires_grad_()
    want, start = 0.0, 0
    for k in LENGTHS:
        part = slice(start, start + k)
        want = want + reference(
            loss, ref_lp[part], b["old"][part], b["adv"][part], b["mask"][part], config
        )
        start += k
    (want_grad,) = torch.autograd.grad(want, ref_lp)
    return got, got_grad, want, want_grad


@pytest.mark.parametrize("loss", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_loss_and_its_gradient_are_tinkers_formula(loss, seed):
    got, got_grad, want, want_grad = ours_and_reference(loss, batch(seed), CONFIGS[loss])
    assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)


def test_the_batches_reach_the_clipped_regions():
    """The references above see clipping (else ppo, cispo and gspo would test only the
    importance-sampling branch)."""
    b = batch(0)
    ratio = torch.exp(b["lp"] - b["old"])
    assert ((ratio < 0.8) | (ratio > 1.2)).any() and ((ratio > 0.8) & (ratio < 1.2)).any()
    seq_log_ratio = [(b["lp"] - b["old"])[b["sequence"] == i].mean() for i in range(2)]
    assert any(abs(float(x)) > 0.05 for x in seq_log_ratio)  # outside gspo's [0.9, 1.05]


@pytest.mark.parametrize("loss", [k for k in CONFIGS if k != "importance_sampling"])
def test_on_policy_every_policy_loss_takes_importance_samplings_gradient(loss):
    b = batch(5, on_policy=True)
    _, grad, _, _ = ours_and_reference(loss, b, TOKEN_LOSSES[loss].config)
    _, is_grad, _, _ = ours_and_reference("importance_sampling", b, {})
    torch.testing.assert_close(grad, is_grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, -b["adv"], rtol=1e-6, atol=1e-7)


def test_a_loss_refuses_config_keys_it_does_not_take():
    with pytest.raises(ValueError, match="dro takes no loss_fn_config clip_low_threshold"):
        PerTokenLoss("dro", {"clip_low_threshold": 0.5})


@pytest.mark.parametrize("loss", [k for k in CONFIGS if k != "importance_sampling"])
def test_a_grpo_job_picks_its_loss(loss):
    """GRPO's loss is the named loss, weighted by its completion-token weights (its
    sequence ratio, for gspo, over the completion tokens): with unit weights, no KL and
    GRPO's clip settings, the loss is the client loss's."""
    b = batch(7)
    weights = b["mask"]
    grpo = GRPO(0.25, 0.3, 0.0, loss, dro_beta=0.2)
    config = {
        k: v
        for k, v in {
            "clip_low_threshold": 0.75,
            "clip_high_threshold": 1.3,
            "beta": 0.2,
        }.items()
        if k in TOKEN_LOSSES[loss].config
    }
    values = {"logprobs": b["old"], "advantages": b["adv"], "weights": weights}
    got, _ = grpo.span_loss(b["lp"], torch.ones_like(weights), values, b["sequence"])
    client = PerTokenLoss(loss, config)
    per_token_values = {**values, "sequence_ratio_mask": weights}
    want, _ = client.span_loss(b["lp"], weights, per_token_values, b["sequence"])
    assert float(got) == pytest.approx(float(want), rel=1e-6)


def test_a_loss_with_a_key_grpo_does_not_set_takes_its_default(monkeypatch):
    """A new loss is its TokenLoss entry: a GRPO job that picks it gets the loss's own
    default for a key GRPO's settings do not map (no KeyError)."""
    import megatron_multilora.training.objectives.grpo as grpo_module
    from megatron_multilora.training.objectives.token_losses import CONFIG_RANGES, TokenLoss

    capped = TokenLoss(("logprobs", "advantages"), {"cap": 3.0}, TOKEN_LOSSES["ppo"].per_token)
    monkeypatch.setitem(grpo_module.TOKEN_LOSSES, "capped", capped)
    monkeypatch.setitem(CONFIG_RANGES, "cap", (">= 1", lambda v: v >= 1.0))
    assert GRPO(0.25, 0.3, 0.0, "capped").config == {"cap": 3.0}
    assert capped.config_problems({"cap": 0.5}) == ["cap=0.5: >= 1"]

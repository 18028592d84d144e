"""The training step's forward/backward through megatron's pipeline schedule (PP=1) gives the
per-slot losses and adapter gradients of a plain per-micro-batch loop on the same weights,
for a dense and a MoE model (with a load-balancing loss), with a filler micro-batch of pads
in the mix that must train nothing."""

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    get_moe_layer_wise_logging_tracker,
)

import megatron_multilora as mm
from megatron_multilora.data.datasets import Example
from megatron_multilora.training import runtime
from megatron_multilora.training.config import AdapterJob
from megatron_multilora.training.objectives import registry
from megatron_multilora.training.step import schedule
from megatron_multilora.training.step.micro_batches import agree, pack_micro_batches
from megatron_multilora.training.step.slot_step import SlotStep, SlotWork
from tests.models import random_example, tiny_gpt, with_slots
from tests.tolerances import chain_atol

N, DIM, VOCAB, PAD = 3, 8, 64, 0
RANKS, ALPHAS = [8, 4, 2], [16.0, 4.0, 8.0]
DENSE = tiny_gpt()
MOE = tiny_gpt(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_shared_expert_intermediate_size=32,
    moe_aux_loss_coeff=0.1,
)


def build(cfg: mm.GPTModelConfig, state=None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = with_slots(mm.build_gpt_model(cfg, calculate_per_token_loss=True), DIM, RANKS, ALPHAS)
    if state is not None:
        model.load_state_dict(state)
    return model


def slot_examples() -> list[list[Example]]:
    gen = torch.Generator().manual_seed(1)

    def example(n: int) -> Example:
        return random_example(n, VOCAB, gen)

    return [[example(n) for n in lengths] for lengths in ([9, 14, 6], [11, 13], [7, 10, 12])]


def reference(model, micro_batches, denominators):
    """Forward and backward each micro-batch on its own; per-slot losses and the gradients
    of the slots with loss tokens (``denominators``: loss tokens per slot)."""
    losses = torch.zeros(len(denominators), dtype=torch.float64)
    # MoE aux losses back-propagate at their plain weight here: megatron's scale is a
    # process-wide tensor that an earlier schedule call may have left at 1/num_microbatches.
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.ones(1)
    for mb in micro_batches:
        mm.set_tokens_per_adapter_slot(model, mb.counts)
        token_loss = model(
            mb.tokens,
            mb.position_ids,
            None,
            labels=mb.labels,
            packed_seq_params=mb.packed_seq_params(),
            padding_mask=mb.padding_mask(),
        )[0]
        total = 0.0
        for s, (span, mask) in enumerate(
            zip(token_loss.split(mb.counts), mb.loss_mask[0].split(mb.counts))
        ):
            if denominators[s]:
                loss = (span * mask).sum() / denominators[s]
                losses[s] += loss.item()
                total = total + loss
        total.backward()
    return losses, {
        s: [p.grad.clone() for p in mm.slot_parameters(model, s)]
        for s in range(len(denominators))
        if denominators[s]
    }


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_schedule_step_matches_a_plain_loop(cfg, monkeypatch):
    # megatron's process-wide aux-loss logging tracker is sized by the first MoE model's
    # layer count (its clear_aux_losses_tracker only zeroes it).
    get_moe_layer_wise_logging_tracker().clear()
    ref_model = build(cfg)
    model = build(cfg, {k: v for k, v in ref_model.state_dict().items() if torch.is_tensor(v)})
    step = SlotStep([model], N, token_budget=32, pad_multiple=1, pad_id=PAD)
    examples = slot_examples()
    plain = pack_micro_batches(examples, 32, 1, PAD)
    # The filler goes in the middle: the micro-batch after it must train normally again.
    filler = step.batcher.filler
    micro_batches = plain[:1] + [filler] + plain[1:]
    assert len(plain) >= 2 and filler.n_pad == filler.tokens.size(1)
    denominators = agree(plain, N).loss_units
    want_losses, want_grads = reference(ref_model, plain, denominators)

    calls = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    step.grad_sync.zero_grad(range(N))
    losses = step.losses(micro_batches, denominators)
    assert len(calls) == len(micro_batches)  # the filler really ran
    torch.testing.assert_close(losses, want_losses, rtol=1e-6, atol=1e-7)
    for s in range(N):
        for p, want in zip(mm.slot_parameters(model, s), want_grads[s]):
            torch.testing.assert_close(p.main_grad, want, rtol=1e-5, atol=1e-7)
            assert p.grad is None  # accumulated into main_grad by the slot's gradient buffer
    assert all(g.abs().sum() > 0 for s in range(N) for g in want_grads[s])

    if cfg.num_moe_experts:
        # The filler's aux-loss gradient really is there, and only its zero scale keeps it out.
        monkeypatch.setattr(schedule, "_set_aux_loss_scale", lambda scale, grad: None)
        step.grad_sync.zero_grad(range(N))
        step.losses(micro_batches, denominators)
        assert any(
            not torch.allclose(p.main_grad, want, rtol=1e-5, atol=1e-7)
            for p, want in zip(mm.slot_parameters(model, 0), want_grads[0])
        )


def check_bf16_step(monkeypatch, device: str, cfg: mm.GPTModelConfig, rel: float = 5e-2) -> None:
    """The training step of a bf16 model against the same step of an fp32 model holding the
    same (bf16-rounded) weights, on ``device``: per-slot losses and every slot gradient, with
    the LoRA GEMMs on ``torch._grouped_mm`` (asserted), at a max rank that is not a multiple
    of 8 and slot ranks below it. Shared with tests/gpu.

    Each error is bounded by ``rel``, or by twice the error of the same bf16 step with the
    LoRA GEMMs on the per-group loop: on CUDA, bf16 arithmetic in the base model alone (cuBLAS
    may reduce split-K partial sums in bf16) put one slot's gradient 9% off fp32 on an H200,
    and the kernel must add no error of its own beyond that."""
    from megatron_multilora.ops import grouped_mm as gmm

    if gmm._GROUPED_MM is None:
        pytest.skip("this torch has no torch._grouped_mm")
    get_moe_layer_wise_logging_tracker().clear()
    dim, ranks = 12, [3, 8, 5]

    def adapted(dtype: torch.dtype) -> torch.nn.Module:
        torch.manual_seed(0)
        model = mm.apply_multi_lora(
            mm.build_gpt_model(cfg, params_dtype=dtype, calculate_per_token_loss=True).to(device),
            N,
            dim,
            1.0,
            row_init_method="normal",
        )
        for slot, (rank, alpha) in enumerate(zip(ranks, ALPHAS)):
            mm.init_adapter_slot(model, slot, rank, alpha)
        return model

    def step_of(model: torch.nn.Module) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        step = SlotStep([model], N, token_budget=32, pad_multiple=1, pad_id=PAD)
        micro_batches = pack_micro_batches(slot_examples(), 32, 1, PAD)
        step.grad_sync.zero_grad(range(N))
        losses = step.losses(micro_batches, agree(micro_batches, N).loss_units)
        return losses.float(), [
            [p.main_grad.float().cpu() for p in mm.slot_parameters(model, s)] for s in range(N)
        ]

    low, looped, ref = adapted(torch.bfloat16), adapted(torch.bfloat16), adapted(torch.float32)
    low.load_state_dict({k: v for k, v in ref.state_dict().items() if torch.is_tensor(v)})
    bf16_weights = {k: v for k, v in low.state_dict().items() if torch.is_tensor(v)}
    looped.load_state_dict(bf16_weights)
    ref.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in bf16_weights.items()}
    )
    want_losses, want_grads = step_of(ref)
    kernel = gmm._GROUPED_MM
    monkeypatch.setattr(gmm, "_GROUPED_MM", None)
    loop_losses, loop_grads = step_of(looped)
    calls = []
    monkeypatch.setattr(gmm, "_GROUPED_MM", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    losses, grads = step_of(low)
    assert calls, "the bf16 step never ran the grouped kernel"

    def error(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))

    for s in range(N):
        bound = max(rel, 2 * error(loop_losses[s], want_losses[s]))
        assert error(losses[s], want_losses[s]) < bound, (s, losses, loop_losses, want_losses)
        for k, (got, loop, want) in enumerate(zip(grads[s], loop_grads[s], want_grads[s])):
            err, floor = error(got, want), error(loop, want)
            assert err < max(rel, 2 * floor), (
                f"slot {s}, parameter {k}: gradient {err:.3e} off fp32 (relative), "
                f"the per-group loop in bf16 {floor:.3e}"
            )


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_bf16_step_matches_fp32(monkeypatch, cfg):
    check_bf16_step(monkeypatch, "cpu", cfg)


def client_items(gen: torch.Generator, poisoned: bool = False) -> list[Example]:
    """A service client's datums for importance_sampling: every target counts; ``poisoned``:
    a sampler log-prob of -1e30, so the ratio, the loss and the gradients are not finite."""
    out = []
    for n in (7, 9):
        tokens = tuple(torch.randint(1, VOCAB, (n,), generator=gen).tolist())
        sampled = [-1e30 if poisoned else -4.0] * (n - 1)
        values = {"logprobs": tuple(sampled), "advantages": (0.5,) * (n - 1)}
        out.append(Example(tokens, (True,) * (n - 1), values, units=1))
    return out


def client_work(slots: dict[int, list[Example]]) -> dict:
    loss = registry.client_objective("importance_sampling")
    return {s: SlotWork(items, loss, mean=False) for s, items in slots.items()}


def main_grads(model, slot: int) -> list[torch.Tensor]:
    return [p.main_grad.clone() for p in mm.slot_parameters(model, slot)]


def test_a_clients_non_finite_call_is_left_out_and_its_neighbours_are_as_alone():
    """The service's use of the step: gradients accumulate over calls until ``apply``; a
    slot whose loss and gradients turn non-finite in a call beside another is skipped, its
    earlier gradients kept, and the other's gradients, loss and log-probs are those of the
    same calls alone: beside the other slot its frozen GEMMs (fp32, run whole) have more rows,
    so within the rounding of their sums (exact with bf16 GEMMs: test_mixed_alone_main_widths)."""
    gen = torch.Generator().manual_seed(5)
    first, second, bad = client_items(gen), client_items(gen), client_items(gen, poisoned=True)
    state = {k: v for k, v in build(DENSE).state_dict().items() if torch.is_tensor(v)}
    mixed, alone = build(DENSE, state), build(DENSE, state)
    mixed_step = SlotStep([mixed], N, 32, 1, PAD)
    alone_step = SlotStep([alone], N, 32, 1, PAD)
    for step in (mixed_step, alone_step):  # a first call of both clients, all finite
        step.train(client_work({0: first, 2: second}))
    earlier = main_grads(mixed, 2)
    got = mixed_step.train(client_work({0: second, 2: bad}), keep=("logprobs",))
    want = alone_step.train(client_work({0: second}), keep=("logprobs",))
    assert got.skipped == {2} and want.skipped == set()
    sums, longest = 2 * (4 * DENSE.num_layers + 1), max(DENSE.ffn_hidden_size, VOCAB, 32)

    def close(a: torch.Tensor, b: torch.Tensor) -> None:
        torch.testing.assert_close(a, b, rtol=0, atol=chain_atol(b, sums, longest))

    close(got.losses[0], want.losses[0])
    for a, b in zip(got.kept["logprobs"][0], want.kept["logprobs"][0], strict=True):
        close(torch.tensor(a), torch.tensor(b))
    for g, w in zip(main_grads(mixed, 0), main_grads(alone, 0)):
        close(g, w)
    for g, w in zip(main_grads(mixed, 2), earlier):  # the poisoned call added nothing
        assert torch.equal(g, w)


def test_apply_steps_every_accumulated_slot_with_one_sync_and_one_norm_pass(monkeypatch):
    model = build(DENSE)
    step = SlotStep([model], N, 32, 1, PAD)
    gen = torch.Generator().manual_seed(6)
    step.train(client_work({s: client_items(gen) for s in range(N)}))
    calls = {"sync": 0, "norms": 0}
    sync, norms = step.grad_sync.sync, step.grad_sync.norms
    monkeypatch.setattr(
        step.grad_sync, "sync", lambda slots: (calls.update(sync=calls["sync"] + 1), sync(slots))[1]
    )
    monkeypatch.setattr(
        step.grad_sync, "norms", lambda: (calls.update(norms=calls["norms"] + 1), norms())[1]
    )
    optimizers = {
        s: runtime.start_job(
            [model], s, AdapterJob(name=f"c{s}", dataset="-", rank=RANKS[s], max_steps=1), 1, DENSE
        )
        for s in range(N)
    }
    for s in range(N):  # start_job re-initialises: accumulate again
        step.drop([s])
    step.train(client_work({s: client_items(gen) for s in range(N)}))
    before = {s: [p.detach().clone() for p in mm.slot_parameters(model, s)] for s in range(N)}
    calls.update(sync=0, norms=0)
    norms_of, skipped = step.apply(optimizers)
    assert calls == {"sync": 1, "norms": 1} and skipped == set() and len(norms_of) == N
    for s in range(N):
        assert any(not torch.equal(p, q) for p, q in zip(mm.slot_parameters(model, s), before[s]))
        assert all(p.main_grad.abs().sum() == 0 for p in mm.slot_parameters(model, s))

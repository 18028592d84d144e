"""The recipe's step path on a MoE model under EP=2 (both dispatchers) against one process.

Each data-parallel rank packs its own examples, so its micro-batches differ from the other
rank's in number and length (what the allgather dispatcher cannot take unpadded), and a
slot has tokens on one rank only while another claimed slot has none anywhere. The step
(equalize, per-slot loss normalisation, forward/backward, per-slot gradient sync) must give
every adapter the loss and gradients of one process running all ranks' micro-batches
unpadded, and the expert GEMMs must run over the slots with tokens on some EP rank only, at
the largest rank among them. Evaluation and generation run under EP=2 too.
"""

import pytest
import torch
from megatron.core import parallel_state

import megatron_multilora as mm
from megatron_multilora.data.datasets import Example
from megatron_multilora.layers import expert_lora
from megatron_multilora.training.step import evaluation, generation, schedule
from megatron_multilora.training.step.grad_sync import SlotGradSync
from megatron_multilora.training.step.micro_batches import MicroBatcher, agree, pack_micro_batches
from megatron_multilora.training.step.slot_adamw import SlotAdamW
from megatron_multilora.training.step.slot_step import SlotStep, start_reducing_losses
from tests.distributed.conftest import assert_all_ranks, compare
from tests.distributed.harness import load_full_state
from tests.models import random_example, tiny_gpt, with_slots

N, DIM, VOCAB, E = 4, 16, 64, 4
# Slot 0 (rank 4) trains on both ranks, slot 1 (rank 8) on DP rank 0 only; slot 2 is
# claimed at the max rank but idle; slot 3 is free (alpha 0).
RANKS, ALPHAS = [4, 8, 16, DIM], [8.0, 16.0, 4.0, 0.0]
TRAINED = (0, 1)
BUDGET, PAD = 40, 0
REL = 2e-5


def cfg(dispatcher: str, aux_loss: float) -> mm.GPTModelConfig:
    return tiny_gpt(
        num_moe_experts=E,
        moe_router_topk=2,
        moe_shared_expert_intermediate_size=32,
        moe_token_dispatcher_type=dispatcher,
        moe_aux_loss_coeff=aux_loss,
    )


def build(config: mm.GPTModelConfig, sp: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = mm.build_gpt_model(config, sequence_parallel=sp, calculate_per_token_loss=True)
    return with_slots(model, DIM, RANKS, ALPHAS)


def examples(seed: int, lengths: list[int]) -> list[Example]:
    gen = torch.Generator().manual_seed(seed)
    return [random_example(n, VOCAB, gen) for n in lengths]


def rank_data(dp_rank: int) -> list[list[Example]]:
    """DP rank 0: slots 0 and 1, two micro-batches; rank 1: slot 0 only, one shorter one."""
    if dp_rank == 0:
        return [examples(1, [9, 14]), examples(2, [11, 13, 7]), [], []]
    return [examples(3, [10, 6]), [], [], []]


def both_ranks_data() -> list[list[Example]]:
    """Each slot's examples of both ranks: shared out again, every other one, slot 1's
    three give the ranks micro-batches of different lengths."""
    return [a + b for a, b in zip(rank_data(0), rank_data(1))]


def micro_batches(dp_rank: int, pad_multiple: int = 1):
    return pack_micro_batches(rank_data(dp_rank), BUDGET, pad_multiple, PAD)


def reference(config):
    """One process running both ranks' micro-batches unpadded: (model state, per-slot
    losses, per-slot full gradients)."""
    ref = build(config)
    state = {k: v.clone() for k, v in ref.state_dict().items() if torch.is_tensor(v)}
    all_mbs = micro_batches(0) + micro_batches(1)
    denominators = sum(mb.loss_units_per_slot() for mb in all_mbs)
    losses = schedule.per_slot_losses(ref, all_mbs, denominators)
    return ref, state, losses, {s: grads(ref, s, main_grad=False) for s in TRAINED}


def train_step(model, mbs) -> torch.Tensor:
    """The recipe's step on this rank's (equalized) micro-batches; per-slot losses."""
    sync = SlotGradSync(SlotAdamW.of(model).rows)
    sync.zero_grad(TRAINED)
    denominators = agree(mbs, N).loss_units
    losses = start_reducing_losses(schedule.per_slot_losses(model, mbs, denominators))()
    sync.sync(TRAINED)
    return losses


def compare_step(failures, model, losses, ref_losses, ref_grads) -> None:
    compare(failures, losses, ref_losses, REL, "per-slot losses")
    for s in TRAINED:
        got = grads(model, s, main_grad=True)
        for k, want in ref_grads[s].items():
            compare(failures, got[k], want, REL, f"slot {s} gradient {k}")
        if not any(v.abs().sum() > 0 for k, v in got.items() if ".experts." in k):
            failures.append(f"slot {s}: no expert gradient at all")


def grads(model, slot: int, main_grad: bool) -> dict[str, torch.Tensor]:
    def value(p):
        g = p.main_grad if main_grad else p.grad
        return torch.zeros_like(p) if g is None else g

    return mm.get_slot_tensors(model, slot, value=value)


@pytest.mark.parametrize("aux_loss", [0.0, 0.1], ids=["no_aux_loss", "aux_loss"])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_ep2_step_matches_one_process(layout, dispatcher, aux_loss, monkeypatch):
    """With a load-balancing loss, pads (and a filler of pads only) must stay out of it."""
    config = cfg(dispatcher, aux_loss)
    layout(tp=1)
    ref, state, ref_losses, ref_grads = reference(config)
    # Evaluation is given both ranks' data; each data-parallel rank evaluates a share.
    ref_eval = evaluation.eval_losses(SlotStep(ref, N, 1000, 1, PAD), both_ranks_data())
    ref_gen = [generation.greedy_generate(ref, prompts(d), N, 3, -1, 1, PAD) for d in (0, 1)]
    mm.destroy_parallel()

    layout(tp=1, ep=2)
    model = build(config)
    load_full_state(model, state, config)
    shapes = []
    real = expert_lora.lora_term  # what the expert layers compute their LoRA term with

    def recording(x, a, b, *args):
        shapes.extend([tuple(a[0].shape), tuple(b[0].shape)])
        return real(x, a, b, *args)

    monkeypatch.setattr(expert_lora, "lora_term", recording)
    d = parallel_state.get_data_parallel_rank()
    mbs = MicroBatcher(model, N, BUDGET, 1, PAD).equalize(micro_batches(d))
    losses = train_step(model, mbs)

    failures: list[str] = []
    own = micro_batches(d)
    if d == 1 and (
        [mb.tokens.size(1) for mb in mbs[: len(own)]] == [mb.tokens.size(1) for mb in own]
        or len(mbs) == len(own)
    ):
        failures.append("the scenario must pad this rank's micro-batches and add a filler")
    if [mb.ep_slots for mb in mbs] != [(0, 1), (0, 1)]:
        failures.append(f"ep_slots {[mb.ep_slots for mb in mbs]}: want slots 0, 1 in both")
    compare_step(failures, model, losses, ref_losses, ref_grads)
    # Two slots x 2 local experts per GEMM, at rank 8 (slot 1's): not slot 2's 16, not 4 slots.
    expected = {
        (2 * E // 2, 8, 32),
        (2 * E // 2, 48 * 2, 8),
        (2 * E // 2, 8, 48),
        (2 * E // 2, 32, 8),
    }
    if not shapes or set(shapes) - expected:
        failures.append(
            f"expert GEMM weight shapes {sorted(set(shapes))}, want within {sorted(expected)}"
        )

    monkeypatch.undo()
    got_eval = evaluation.eval_losses(SlotStep(model, N, 1000, 1, PAD), both_ranks_data())
    if not torch.equal(got_eval.isnan(), ref_eval.isnan()):
        failures.append(f"eval losses {got_eval} != one process's {ref_eval}")
    compare(failures, got_eval.nan_to_num(), ref_eval.nan_to_num(), REL, "eval losses")
    got_gen = generation.greedy_generate(model, prompts(d), N, 3, -1, 1, PAD)
    if got_gen != ref_gen[d]:
        failures.append(f"generations {got_gen} != one process's {ref_gen[d]}")
    assert_all_ranks(failures)


def prompts(dp_rank: int) -> list[tuple[int, list[int]]]:
    """Prompts of rank-dependent lengths (so forwards differ in length across EP ranks)."""
    gen = torch.Generator().manual_seed(10 + dp_rank)
    return [
        (slot, torch.randint(1, VOCAB, (n,), generator=gen).tolist())
        for slot, n in ((0, 5 + 3 * dp_rank), (1, 4))
    ]


def test_tp2_sp_step_keeps_sequence_padding_out_of_the_aux_loss(layout):
    """TP=2 + SP pads micro-batches to even lengths; megatron's padding mask is split over
    the sequence shards with the tokens."""
    config = cfg("alltoall", 0.1)
    layout(tp=1)
    _, state, ref_losses, ref_grads = reference(config)
    mm.destroy_parallel()

    layout(tp=2, sp=True)
    model = build(config, sp=True)
    load_full_state(model, state, config)
    mbs = MicroBatcher(model, N, BUDGET, 2, PAD).equalize(micro_batches(0, 2) + micro_batches(1, 2))
    failures: list[str] = []
    if not any(mb.n_pad for mb in mbs):
        failures.append("no micro-batch was padded: the test would not test padding")
    compare_step(failures, model, train_step(model, mbs), ref_losses, ref_grads)
    assert_all_ranks(failures)

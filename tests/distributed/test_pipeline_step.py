"""The training step under pipeline parallelism against PP=1 on the same weights.

Each case builds the model twice in the same processes with ``build_model_chunks``: first at
PP=1 (TP=1, EP=1; every rank a data-parallel replica running a plain per-micro-batch loop
over all the data, no schedule, no collective), then at the tested layout, whose base
weights are equal by construction (checked for one tensor) and whose adapter slots get the
PP=1 model's weights (``get_slot_tensors``/``set_slot_tensors``; B is non-zero, so every
factor gets a gradient). The step (``equalize_micro_batches``, megatron's 1F1B or
interleaved schedule, per-slot gradient sync) must give every adapter PP=1's loss and every
gradient, compared by global key, and the global per-slot gradient norms.

The model has a sliding window in its second layer, shorter than most examples, and a Gated
DeltaNet in its third. The data:
four slots of unequal LoRA ranks, three with examples and one claimed but idle
(zero tokens); micro-batches of different lengths and slot mixes, padded to one length by
the step, with a filler of pads only in the middle. Under EP=2 the two data-parallel ranks
hold different data (different micro-batch counts and lengths).

Matrix: at PP=2 (2 processes), 1F1B and interleaved (two virtual stages per rank, 4
layers) x dense, MoE alltoall and allgather (with a load-balancing loss) x no, full and
selective (``mlp`` / ``moe``) recompute; at 4 processes PP=2 x TP=2 with sequence
parallelism (dense 1F1B; MoE interleaved with selective recompute) and PP=2 x EP=2 (alltoall
1F1B with full recompute; allgather interleaved). Without recompute at PP=2, and in every
4-process case, evaluation losses and generation are checked too.

Interleaving is exact at PP=2 since the builder sets ``batch_p2p_comm=False`` for virtual
stages (with batched p2p, gloo paired the single peer's sends and receives by order and
swapped activations and gradients).

Measured worst relative errors (max|got - want| / max|want| per tensor, printed per test by
the run's summary): PP=2 dense 4.4e-7, MoE 3.2e-7 (every schedule and recompute mode);
PP=2 x TP=2 + SP 1.1e-6; PP=2 x EP=2 3.3e-7. Tolerances: 1e-6 (losses), 1e-5 (gradients,
norms, eval losses). Reproduce with ``PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/torchrun
--standalone --nproc-per-node 2 --local-ranks-filter 0 -m pytest -q
tests/distributed/test_pipeline_step.py`` (and ``--nproc-per-node 4``).
"""

import dataclasses
import functools
import math
import operator

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

import megatron_multilora as mm
from megatron_multilora.data.datasets import Example
from megatron_multilora.models.gpt import build_model_chunks
from megatron_multilora.models.gpt_config import DeltaNetConfig
from megatron_multilora.training.config import AdapterJob
from megatron_multilora.training.step import evaluation, generation
from megatron_multilora.training.step.micro_batches import (
    MicroBatch,
    agree,
    micro_batch_multiple,
    pack_micro_batches,
)
from megatron_multilora.training.step.slot_optimizer import SlotOptimizer
from megatron_multilora.training.step.slot_step import SlotStep, slot_work
from tests.distributed.conftest import assert_all_ranks, compare
from tests.models import random_example, tiny_gpt, with_slots
from tests.unit.test_step_schedule import reference

N, DIM, VOCAB, PAD, BUDGET = 4, 8, 64, 0, 32
RANKS, ALPHAS = [8, 2, 4, 5], [16.0, 4.0, 8.0, 10.0]
IDLE = 2  # claimed, but no examples anywhere
# Example lengths per slot, for each of two data shares (data-parallel ranks under EP=2;
# one rank runs both otherwise).
SHARES = [[[9, 14, 6], [11, 13], [], [7, 10]], [[12], [], [], [8, 15, 5]]]
REL_LOSS, REL_GRAD = 1e-6, 1e-5
# A 4-token window in the second layer and a Gated DeltaNet (Qwen3.5's linear attention) in
# the third: a stage that numbered its layers from 1 would put them in others.
DENSE = tiny_gpt(
    num_layers=4,
    sliding_window=4,
    layer_types=["full_attention", "sliding_attention", "linear_attention", "full_attention"],
    linear_attention=DeltaNetConfig(2, 4, 8, 12, 4),
)
MOE = dataclasses.replace(
    DENSE,
    num_moe_experts=4,
    moe_router_topk=2,
    moe_shared_expert_intermediate_size=32,
    moe_aux_loss_coeff=0.1,
)


def model_config(model: str, recompute: str | None) -> mm.GPTModelConfig:
    cfg = (
        DENSE
        if model == "dense"
        else dataclasses.replace(MOE, moe_token_dispatcher_type=model.removeprefix("moe_"))
    )
    modules = None if recompute != "selective" else ["mlp"] if model == "dense" else ["moe"]
    return dataclasses.replace(cfg, recompute_granularity=recompute, recompute_modules=modules)


def share_examples(share: int) -> list[list[Example]]:
    gen = torch.Generator().manual_seed(share)

    def example(n: int) -> Example:
        return random_example(n, VOCAB, gen)

    return [[example(n) for n in lengths] for lengths in SHARES[share]]


def all_examples() -> list[list[Example]]:
    shares = [share_examples(i) for i in range(len(SHARES))]
    return [functools.reduce(operator.iadd, (share[s] for share in shares), []) for s in range(N)]


def micro_batches(shares: range, pad_multiple: int) -> list[MicroBatch]:
    """The shares' micro-batches, each share packed on its own: the MoE load-balancing loss
    is per micro-batch, so PP=1 must see the same ones as the data-parallel ranks."""
    return [
        mb
        for i in shares
        for mb in pack_micro_batches(share_examples(i), BUDGET, pad_multiple, PAD)
    ]


def prompts() -> list[tuple[int, list[int]]]:
    gen = torch.Generator().manual_seed(3)
    return [
        (s, torch.randint(1, VOCAB, (n,), generator=gen).tolist())
        for s, n in ((0, 5), (1, 3), (3, 7), (0, 4))
    ]


def build(cfg: mm.GPTModelConfig, sp: bool = False) -> list[torch.nn.Module]:
    return with_slots(
        build_model_chunks(cfg, sp, calculate_per_token_loss=True), DIM, RANKS, ALPHAS
    )


def last_proj_weight(chunks: list[torch.nn.Module], cfg: mm.GPTModelConfig) -> torch.Tensor | None:
    """The last layer's base attention-output weight, on the stage that holds it (else None)."""
    layer = chunks[-1].decoder.layers[-1]
    if layer.layer_number != cfg.num_layers:
        return None
    return next(
        p
        for name, p in layer.self_attention.linear_proj.named_parameters()
        if name.endswith("weight") and "adapters" not in name
    )


def grads(model, slot: int, attr: str) -> dict[str, torch.Tensor]:
    """Slot ``slot``'s whole-model gradients by global key (zeros where none flowed)."""

    def value(p):
        g = getattr(p, attr, None)
        return torch.zeros_like(p) if g is None else g

    return mm.get_slot_tensors(model, slot, value=value)


def check_step(
    layout,
    cfg: mm.GPTModelConfig,
    vpp: int | None = None,
    tp: int = 1,
    ep: int = 1,
    extras: bool = False,
) -> None:
    """The step at PP=2 with ``vpp``, ``tp`` (with SP) and ``ep`` against PP=1; with
    ``extras`` also evaluation and generation."""
    # megatron's process-wide aux-loss logging tracker is sized by the first MoE model's
    # layer count (its clear_aux_losses_tracker only zeroes it).
    get_moe_layer_wise_logging_tracker().clear()
    layout()
    ref = build(cfg)
    want_proj = last_proj_weight(ref, cfg).detach().clone()
    adapters = {s: mm.get_slot_tensors(ref, s) for s in range(N)}
    ref_mbs = micro_batches(range(len(SHARES)), 1)
    want_losses, _ = reference(ref[0], ref_mbs, sum(mb.loss_units_per_slot() for mb in ref_mbs))
    want_grads = {s: grads(ref, s, "grad") for s in range(N)}
    want_norms = [torch.stack([g.norm() for g in want_grads[s].values()]).norm() for s in range(N)]
    if extras:
        want_eval = evaluation.eval_losses(SlotStep(ref, N, BUDGET, 1, PAD), all_examples())
        want_gen = generation.greedy_generate(ref, prompts(), N, 4, -1, 1, PAD, kv_cache=False)
    del ref

    layout(pp=2, vpp=vpp, tp=tp, ep=ep, sp=tp > 1)
    model = build(cfg, sp=tp > 1)
    failures: list[str] = []
    got_proj = last_proj_weight(model, cfg)
    if got_proj is not None:  # the premise: the same base weights per global layer
        if tp > 1:
            want_proj = want_proj.chunk(tp, got_proj.partition_dim)[
                parallel_state.get_tensor_model_parallel_rank()
            ]
        compare(failures, got_proj, want_proj, 0.0, "base weight of the last layer")
    for s in range(N):
        mm.set_slot_tensors(model, s, adapters[s], RANKS[s], ALPHAS[s])

    step = SlotStep(model, N, BUDGET, tp, PAD)
    dp, d = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    own = micro_batches(range(d, len(SHARES), dp), tp)
    # The filler in the middle: the micro-batch after it must train normally again.
    mbs = step.batcher.equalize(own[:1] + [step.batcher.filler] + own[1:])
    if len(model) != (vpp or 1):
        failures.append(f"{len(model)} model chunks for vpp={vpp}")
    if len({mb.tokens.size(1) for mb in mbs}) != 1 or len({mb.tokens.size(1) for mb in own}) == 1:
        failures.append("the micro-batches must differ in length, and be padded to one under PP")
    if len(mbs) % micro_batch_multiple(model):
        failures.append(f"{len(mbs)} micro-batches for vpp={vpp}")
    step.grad_sync.zero_grad(range(N))
    losses = step.losses(mbs, agree(mbs, N).loss_units)
    step.grad_sync.sync(range(N))

    compare(failures, losses, want_losses, REL_LOSS, "per-slot losses")
    for s in range(N):
        got = grads(model, s, "main_grad")
        if got.keys() != want_grads[s].keys():
            failures.append(
                f"slot {s}: gradient keys {sorted(got.keys() ^ want_grads[s].keys())[:3]} "
                "not in both"
            )
        for key, want in want_grads[s].items():
            # The premise: every factor of a slot with tokens trains, the idle slot's none.
            if (want.abs().sum() > 0) != (s != IDLE):
                failures.append(f"slot {s}: PP=1 gradient {key} is {'non' * (s == IDLE)}zero")
            compare(failures, got.get(key), want, REL_GRAD, f"slot {s} gradient {key}")
        compare(
            failures,
            step.grad_sync.norms()[s],
            want_norms[s],
            REL_GRAD,
            f"slot {s} gradient norm",
        )
    if extras:
        got_eval = evaluation.eval_losses(step, all_examples())
        if not torch.equal(got_eval.isnan(), want_eval.isnan()):  # nan: the idle slot
            failures.append(f"eval losses {got_eval} != {want_eval}")
        compare(failures, got_eval.nan_to_num(), want_eval.nan_to_num(), REL_GRAD, "eval losses")
        got_gen = generation.greedy_generate(model, prompts(), N, 4, -1, tp, PAD)
        if got_gen != want_gen:
            failures.append(f"generations {got_gen} != {want_gen}")
    assert_all_ranks(failures)


@pytest.mark.parametrize(
    "recompute", [None, "full", "selective"], ids=["no_recompute", "full", "selective"]
)
@pytest.mark.parametrize("model", ["dense", "moe_alltoall", "moe_allgather"])
@pytest.mark.parametrize("vpp", [None, 2], ids=["1f1b", "interleaved"])
def test_pp2_step_matches_pp1(layout, vpp, model, recompute):
    check_step(layout, model_config(model, recompute), vpp, extras=recompute is None)


@pytest.mark.world(4)
@pytest.mark.parametrize(
    "vpp, model, recompute, tp, ep",
    [
        (None, "dense", None, 2, 1),
        (2, "moe_alltoall", "selective", 2, 1),
        (None, "moe_alltoall", "full", 1, 2),
        (2, "moe_allgather", None, 1, 2),
    ],
    ids=[
        "tp2_sp_dense_1f1b",
        "tp2_sp_moe_interleaved_selective",
        "ep2_alltoall_1f1b_full",
        "ep2_allgather_interleaved",
    ],
)
def test_pp2_with_tp_or_ep_step_matches_pp1(layout, vpp, model, recompute, tp, ep):
    check_step(layout, model_config(model, recompute), vpp, tp, ep, extras=True)


@pytest.mark.parametrize("poisoned_stage", [0, 1], ids=["first_stage", "last_stage"])
def test_pp2_non_finite_slot_is_skipped_on_every_stage(layout, poisoned_stage):
    """A slot whose weights hold inf on one stage only: the last stage sees its loss go
    non-finite, and every stage skips that slot (weights and optimizer untouched) while the
    others step, exactly as PP=1 decides."""
    layout(pp=2)
    model = build(DENSE)
    bad = 1
    if parallel_state.get_pipeline_model_parallel_rank() == poisoned_stage:
        with torch.no_grad():
            mm.slot_parameters(model, bad)[0].fill_(float("inf"))
    before = {s: [p.detach().clone() for p in mm.slot_parameters(model, s)] for s in range(N)}
    optimizers = {
        s: SlotOptimizer(
            model,
            s,
            AdapterJob(
                name=f"job{s}",
                dataset="-",
                rank=RANKS[s],
                alpha=ALPHAS[s],
                lr=1e-2,
                schedule="constant",
                max_steps=4,
            ),
            4,
        )
        for s in range(N)
        if s != IDLE
    }
    result = SlotStep(model, N, BUDGET, 1, PAD).train(slot_work(all_examples(), optimizers))

    failures: list[str] = []
    if result.skipped != {bad}:  # only a non-finite loss or norm gets a slot skipped
        failures.append(f"skipped {result.skipped}, want {{{bad}}}")
    for s in optimizers:
        changed = any(
            not torch.equal(p, q) for p, q in zip(mm.slot_parameters(model, s), before[s])
        )
        if changed == (s == bad):
            failures.append(
                f"slot {s} {'changed' if changed else 'did not change'} on stage "
                f"{parallel_state.get_pipeline_model_parallel_rank()}"
            )
        if s != bad and not (
            math.isfinite(float(result.losses[s])) and math.isfinite(result.grad_norms[s])
        ):
            failures.append(
                f"slot {s}: loss {float(result.losses[s])}, norm {result.grad_norms[s]}"
            )
    assert_all_ranks(failures)

"""A small MoE GPT with experts, shared experts and attention wrapped, under EP=2 (both
dispatchers), TP=2+SP with EP=1, and TP=2 x EP=2 on 4 processes, against one process.

Reference: TP=1/EP=1 on the same weights, each rank running every data-parallel
micro-batch itself and averaging the gradients. The parallel run gives each DP rank its own
micro-batch and reduces through megatron's DDP and finalize_model_grads.
"""

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

import megatron_multilora as mm
from tests.distributed.conftest import WORLD, assert_all_ranks, compare
from tests.distributed.harness import (
    build,
    load_full_state,
    local_view,
    micro_batch,
    step,
    trainable_grads,
)
from tests.models import tiny_gpt
from tests.reference import dispatch_slot_ids

COUNTS = [[5, 0, 7, 4], [0, 9, 3, 4]]  # per DP rank; zero-token slots on both
REL = 2e-5


def moe_cfg(dispatcher: str, topk: int = 2) -> mm.GPTModelConfig:
    return tiny_gpt(
        num_moe_experts=4,
        moe_router_topk=topk,
        moe_router_pre_softmax=topk == 1,
        moe_shared_expert_intermediate_size=32,
        moe_token_dispatcher_type=dispatcher,
    )


def run_against_reference(layout, cfg, tp, ep, sp):
    layout(tp=1)
    dp = torch.distributed.get_world_size() // tp
    batches = [micro_batch(20 + d, COUNTS[d % 2], cfg.vocab_size) for d in range(dp)]
    ref = build(cfg, ddp=False)
    state = {k: v.clone() for k, v in ref.state_dict().items() if torch.is_tensor(v)}
    ref_losses = [step(ref, b) for b in batches]
    ref_grads = {k: g / dp for k, g in trainable_grads(ref).items()}
    mm.destroy_parallel()

    layout(tp=tp, ep=ep, sp=sp)
    ddp = build(cfg, sp)
    load_full_state(ddp, state, cfg)
    ddp.zero_grad_buffer()
    d = parallel_state.get_data_parallel_rank()
    losses = step(ddp, batches[d])
    finalize_model_grads([ddp])

    failures: list[str] = []
    compare(failures, losses, ref_losses[d], REL, f"per-slot loss (micro-batch {d})")
    like = ddp.module.state_dict(keep_vars=True)
    grads = trainable_grads(ddp)
    n_expert = sum(".experts." in k for k in grads)
    if n_expert == 0:
        failures.append("no expert adapter parameters were trained")
    for k, g in grads.items():
        compare(failures, g, local_view(k, ref_grads, like[k], cfg), REL, k)
    assert_all_ranks(failures)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_ep2_moe_matches_one_process(layout, dispatcher):
    run_against_reference(layout, moe_cfg(dispatcher), tp=1, ep=2, sp=False)


def test_tp2_sp_moe_matches_one_process(layout):
    run_against_reference(layout, moe_cfg("alltoall"), tp=2, ep=1, sp=True)


@pytest.mark.world(4)
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_tp2_ep2_moe_matches_one_process(layout, dispatcher):
    run_against_reference(layout, moe_cfg(dispatcher), tp=2, ep=2, sp=True)


def test_rank_receiving_no_tokens_still_gets_zero_gradients(layout):
    """Route every token to experts 0/1 (EP rank 0): EP rank 1's experts get no rows."""
    layout(tp=1, ep=2)
    cfg = moe_cfg("alltoall", topk=1)
    model = build(cfg, ddp=False)
    with torch.no_grad():
        for layer in model.decoder.layers:
            w = layer.mlp.router.weight  # logits [l, -l, 0, 0]: top-1 is expert 0 or 1
            w[1] = -w[0]
            w[2:] = 0
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    step(
        model, micro_batch(30 + parallel_state.get_data_parallel_rank(), COUNTS[0], cfg.vocab_size)
    )
    failures = []
    for name, linear in mm.layers.lifecycle.named_multi_lora_modules(model):
        if not isinstance(linear, mm.MultiLoRAGroupedExpertLinear):
            continue
        grads = [p.grad for p in linear.adapters.parameters()]
        if any(g is None for g in grads):
            failures.append(f"{name}: an adapter parameter has no gradient")
        elif ep_rank == 1 and any(g.abs().sum() > 0 for g in grads):
            failures.append(f"{name}: idle experts got non-zero gradients")
        elif ep_rank == 0 and all(g.abs().sum() == 0 for g in grads):
            failures.append(f"{name}: busy experts got only zero gradients")
    assert_all_ranks(failures)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_ep2_co_permuted_slot_ids_match_dispatched_rows(layout, dispatcher):
    """Each token carries its slot id in its hidden state through the real EP exchange."""
    layout(tp=1, ep=2)
    counts = COUNTS[parallel_state.get_data_parallel_rank()]
    dispatched, routed = dispatch_slot_ids(build(moe_cfg(dispatcher), ddp=False), counts, 32)
    failures = []
    if dispatched.numel() == 0 and dispatcher == "alltoall":
        failures.append("no rows were dispatched to this rank: the check would be vacuous")
    if not torch.equal(dispatched, routed):
        failures.append(
            f"slot ids differ: dispatched {dispatched.tolist()} routed {routed.tolist()}"
        )
    assert_all_ranks(failures)


def test_ep2_allgather_slot_ids_without_all_gather_single(layout, monkeypatch):
    """torch before 2.13 has no ``dist.all_gather_single``: the slot ids are then gathered
    with ``all_gather_into_tensor`` (the GPU machine's torch 2.11 takes this path)."""
    layout(tp=1, ep=2)
    gathers = []
    real = torch.distributed.all_gather_into_tensor
    monkeypatch.delattr(torch.distributed, "all_gather_single", raising=False)
    monkeypatch.setattr(
        torch.distributed,
        "all_gather_into_tensor",
        lambda out, inp, *a, **kw: gathers.append(inp.dtype) or real(out, inp, *a, **kw),
    )
    counts = COUNTS[parallel_state.get_data_parallel_rank()]
    dispatched, routed = dispatch_slot_ids(build(moe_cfg("allgather"), ddp=False), counts, 32)
    failures = []
    if torch.int64 not in gathers:  # the slot ids' gather (megatron's own gathers are float)
        failures.append(f"the slot ids were not gathered with all_gather_into_tensor: {gathers}")
    if not torch.equal(dispatched, routed):
        failures.append(
            f"slot ids differ: dispatched {dispatched.tolist()} routed {routed.tolist()}"
        )
    assert_all_ranks(failures)


def test_expert_adapters_reshard_between_ep1_and_ep2(layout):
    """Full adapter tensors gathered at EP=1 load at EP=2 as each rank's experts, and gather
    back to the same tensors (what checkpoints and exports rely on)."""
    from megatron_multilora.layers.slot_tensors import get_slot_tensors, set_slot_tensors

    layout(tp=1)
    full = get_slot_tensors(build(moe_cfg("alltoall"), ddp=False), 2)
    mm.destroy_parallel()
    layout(tp=1, ep=2)
    torch.manual_seed(5)
    model = build(moe_cfg("alltoall"), ddp=False)
    mm.clear_adapter_slot(model, 2, init_key="other")
    set_slot_tensors(model, 2, full, rank=1, alpha=2.0)
    rank = parallel_state.get_expert_model_parallel_rank()
    failures = []
    fc1 = model.decoder.layers[0].mlp.experts.linear_fc1
    want = full["decoder.layers.0.mlp.experts.linear_fc1.adapter.linear_in.weight"].chunk(2)[rank]
    if not torch.equal(fc1.adapters[2].linear_in.weight[:, :1], want):
        failures.append("local experts do not hold their slice of the full tensor")
    back = get_slot_tensors(model, 2)
    failures += [k for k, v in full.items() if not torch.equal(back[k], v)]
    assert_all_ranks(failures)


def test_layout_fixture_skips_an_expert_parallel_size_the_world_cannot_hold(layout):
    with pytest.raises(pytest.skip.Exception, match=f"ep={2 * WORLD}"):
        layout(tp=1, ep=2 * WORLD)

"""Per-slot gradient sync against megatron's DistributedDataParallel + finalize_model_grads.

The same model, built twice, runs the same micro-batches; megatron reduces every slot, the
sync only the slots it is given. Layouts: DP=2, TP=2+SP (with a MoE, so the expert grads are
reduced over the TP ranks that share the experts), EP=2, and TP=2 x EP=2 on 4 processes,
where all three reductions (data, expert-data, tensor parallel) take part.
"""

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

import megatron_multilora as mm
from megatron_multilora.training.step.grad_sync import SlotGradSync
from megatron_multilora.training.step.slot_adamw import SlotAdamW
from tests.distributed.conftest import assert_all_ranks, compare
from tests.distributed.harness import ALPHAS, DIM, RANKS, N, micro_batch, step
from tests.models import tiny_gpt, with_slots

DENSE = tiny_gpt(
    gated_linear_unit=True,
)
MOE = tiny_gpt(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_shared_expert_intermediate_size=32,
)
# Per micro-batch; each has a zero-token slot, every slot has tokens somewhere in the step.
COUNTS = [[5, 0, 7, 4], [0, 9, 3, 4]]
REL = 1e-6


def build(cfg: mm.GPTModelConfig, sp: bool, dtype: torch.dtype = torch.float32):
    """The recipe's model: per-token loss (gradients summed over DP ranks, not averaged)."""
    torch.manual_seed(0)  # the same base weights on every build
    model = mm.build_gpt_model(
        cfg, sequence_parallel=sp, params_dtype=dtype, calculate_per_token_loss=True
    )
    return with_slots(model, DIM, RANKS, ALPHAS)


def batches(cfg: mm.GPTModelConfig, counts: list[list[int]]):
    d = parallel_state.get_data_parallel_rank()  # each DP rank its own micro-batches
    return [micro_batch(100 * d + k, c, cfg.vocab_size) for k, c in enumerate(counts)]


LAYOUTS = {  # name: (model config, tp, ep, sp)
    "dp2": (DENSE, 1, 1, False),
    "tp2_sp_moe": (MOE, 2, 1, True),
    "ep2_moe": (MOE, 1, 2, False),
    "tp2_ep2_sp_moe": (MOE, 2, 2, True),
}


def _matches_megatron(layout, name: str) -> None:
    cfg, tp, ep, sp = LAYOUTS[name]
    layout(tp=tp, ep=ep, sp=sp)
    mbs = batches(cfg, COUNTS)
    ref = build(cfg, sp)
    ddp = DistributedDataParallel(
        ref.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), ref
    )
    ddp.zero_grad_buffer()
    want_losses = [step(ddp, mb) for mb in mbs]
    finalize_model_grads([ddp])

    model = build(cfg, sp)
    grads = SlotGradSync(SlotAdamW.of(model).rows)
    grads.zero_grad(range(N))
    losses = [step(model, mb) for mb in mbs]
    grads.sync(range(N))

    failures: list[str] = []
    for k, (got, want) in enumerate(zip(losses, want_losses)):
        compare(failures, got, want, 0.0, f"per-slot loss, micro-batch {k}")
    n_expert = 0
    for slot in range(N):
        for i, (p, q) in enumerate(
            zip(mm.slot_parameters(model, slot), mm.slot_parameters(ref, slot))
        ):
            n_expert += not getattr(p, "allreduce", True)
            if q.main_grad.abs().sum() == 0:
                failures.append(f"slot {slot} param {i}: zero reference gradient (vacuous)")
            compare(failures, p.main_grad, q.main_grad, REL, f"slot {slot} param {i}")
    if (cfg is MOE) != (n_expert > 0):
        failures.append(f"{n_expert} expert adapter parameters")
    assert_all_ranks(failures)


@pytest.mark.parametrize("name", ["dp2", "tp2_sp_moe", "ep2_moe"])
def test_sync_matches_megatron_ddp(layout, name):
    _matches_megatron(layout, name)


@pytest.mark.world(4)
def test_sync_matches_megatron_ddp_tp2_ep2(layout):
    _matches_megatron(layout, "tp2_ep2_sp_moe")


def _absent_slots_cost_nothing(layout, monkeypatch, name: str, groups: int) -> None:
    """Slots 1 and 3 have no tokens all step: syncing slots 0 and 2 takes one collective per
    group of size > 1 carrying only their gradients; syncing none takes no collective."""
    cfg, tp, ep, sp = LAYOUTS[name]
    layout(tp=tp, ep=ep, sp=sp)
    model = build(cfg, sp)
    grads = SlotGradSync(SlotAdamW.of(model).rows)
    grads.zero_grad(range(N))
    for mb in batches(cfg, [[9, 0, 7, 0], [4, 0, 12, 0]]):
        step(model, mb)

    sent: list[int] = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        sent.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counting)
    grads.sync([])
    failures = [f"sync([]) ran {len(sent)} collectives"] if sent else []
    grads.sync([0, 2])
    monkeypatch.undo()

    params = [p for s in (0, 2) for p in mm.slot_parameters(model, s)]
    numel = {
        "dp": sum(p.numel() for p in params if getattr(p, "allreduce", True)),
        "edp": sum(p.numel() for p in params if not getattr(p, "allreduce", True)),
        "tp": sum(p.numel() for p in params if getattr(p, "sequence_parallel", False)),
    }
    sizes = {
        "dp": parallel_state.get_data_parallel_world_size(),
        "edp": parallel_state.get_expert_data_parallel_world_size(),
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
    }
    want = [numel[g] for g in ("dp", "edp", "tp") if sizes[g] > 1 and numel[g]]
    if len(want) != groups or sent != want:
        failures.append(f"collective sizes {sent}, expected {want} ({groups} groups)")
    for slot in (1, 3):
        for i, p in enumerate(mm.slot_parameters(model, slot)):
            if p.main_grad.abs().sum() != 0:
                failures.append(f"absent slot {slot} param {i} has a non-zero gradient")
    assert_all_ranks(failures)


@pytest.mark.parametrize("name,groups", [("dp2", 1), ("tp2_sp_moe", 2), ("ep2_moe", 1)])
def test_absent_slots_cost_no_collective(layout, monkeypatch, name, groups):
    _absent_slots_cost_nothing(layout, monkeypatch, name, groups)


@pytest.mark.world(4)
def test_absent_slots_cost_no_collective_tp2_ep2(layout, monkeypatch):
    _absent_slots_cost_nothing(layout, monkeypatch, "tp2_ep2_sp_moe", 3)


def test_bf16_grads_accumulate_in_fp32(layout):
    """Two micro-batches of a bf16 model add up in fp32 ``main_grad``, exactly the fp32 sum
    of the two bf16 gradients; ``.grad`` is freed."""
    layout(tp=1)
    mbs = batches(DENSE, COUNTS)
    plain = build(DENSE, False, torch.bfloat16)
    want = [
        torch.zeros_like(p, dtype=torch.float32)
        for s in range(N)
        for p in mm.slot_parameters(plain, s)
    ]
    params = [p for s in range(N) for p in mm.slot_parameters(plain, s)]
    for mb in mbs:
        step(plain, mb)
        for w, p in zip(want, params):
            if p.grad is not None:
                w += p.grad.float()
                p.grad = None

    model = build(DENSE, False, torch.bfloat16)
    SlotGradSync(SlotAdamW.of(model).rows).zero_grad(range(N))
    for mb in mbs:
        step(model, mb)
    failures: list[str] = []
    for i, (w, p) in enumerate(
        zip(want, (p for s in range(N) for p in mm.slot_parameters(model, s)))
    ):
        if p.dtype != torch.bfloat16 or p.main_grad.dtype != torch.float32 or p.grad is not None:
            failures.append(
                f"param {i}: {p.dtype} with {p.main_grad.dtype} main_grad, "
                f"grad {'freed' if p.grad is None else 'kept'}"
            )
        compare(failures, p.main_grad, w, 0.0, f"param {i}")
    if all(w.abs().sum() == 0 for w in want):
        failures.append("every gradient is zero (vacuous)")
    assert_all_ranks(failures)

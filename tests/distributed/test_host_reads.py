"""No host read inside the adapted layers' forward or backward, under every layout: a read of a
tensor's value (``aten::_local_scalar_dense``) is a device sync on a GPU, and a step that
syncs once per layer is bound by its host. Counted under torch.profiler with Python stacks,
reads whose call stack passes through the package's layers or ops, on every rank, for TP+SP
(dense and MoE), EP, PP and full recompute, through the training step's schedule. The grouped
GEMM's insides are not counted (a loop that reads its group ends on the CPU, one kernel that
reads them on the device on a GPU)."""

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import megatron_multilora as mm
from benchmarks import launches
from megatron_multilora.data.datasets import Example
from megatron_multilora.training.step import schedule
from megatron_multilora.training.step.micro_batches import MicroBatcher, agree
from megatron_multilora.training.step.slot_adamw import SlotAdamW
from tests.distributed.conftest import assert_all_ranks
from tests.unit.test_step_schedule import DENSE, MOE

N, DIM, VOCAB = 3, 8, DENSE.vocab_size
OURS = ("megatron_multilora/layers/", "megatron_multilora/ops/")
BACKWARD = "autograd::engine::evaluate_function"


def slot_examples() -> list[list[Example]]:
    gen = torch.Generator().manual_seed(0)

    def example(n: int) -> Example:
        tokens = torch.randint(1, VOCAB, (n,), generator=gen).tolist()
        return Example(tuple(tokens), (False,) * (n // 2) + (True,) * (n - 1 - n // 2))

    return [[example(9), example(14)], [], [example(11)]]  # slot 1 without rows


def our_reads(fn) -> list[str]:
    """The host reads of ``fn`` in backward (any: autograd runs no Python frame around the
    backward of a plain op) and those in forward whose Python stack passes through the
    package's layers or ops, each named by its innermost such frame (or autograd node)."""
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        fn()
    found = []
    for event in prof.events():
        if event.name != launches.HOST_READ or launches._inside(event):
            continue
        parent = event.cpu_parent
        while parent is not None and not (
            any(p in parent.name for p in OURS) or parent.name.startswith(BACKWARD)
        ):
            parent = parent.cpu_parent
        if parent is not None:
            found.append(parent.name)
    return found


@pytest.mark.parametrize(
    "case",
    [
        dict(tp=2, sp=True),
        dict(tp=2, sp=True, moe=True),
        dict(ep=2, moe=True),
        dict(pp=2),
        dict(tp=2, recompute="full"),
    ],
    ids=["tp2-sp", "tp2-sp-moe", "ep2-moe", "pp2", "tp2-recompute"],
)
def test_adapted_layers_read_nothing_back(layout, case):
    case = dict(case)
    moe, recompute = case.pop("moe", False), case.pop("recompute", None)
    layout(**case)
    cfg = dataclasses.replace(MOE if moe else DENSE, recompute_granularity=recompute)
    torch.manual_seed(0)
    model = mm.apply_multi_lora(
        mm.build_gpt_model(
            cfg, sequence_parallel=case.get("sp", False), calculate_per_token_loss=True
        ),
        N,
        DIM,
        1.0,
        row_init_method="normal",
    )
    for slot, rank in enumerate((8, 4, 2)):
        mm.init_adapter_slot(model, slot, rank, 2.0 * rank)
    SlotAdamW.of(model)
    tp = case.get("tp", 1)
    batcher = MicroBatcher(model, N, 64, tp if case.get("sp") else 1, 0)
    mbs = batcher.ready(slot_examples())
    units = agree(mbs, N).loss_units

    def step() -> None:
        schedule.per_slot_results(model, mbs, units)

    step()  # first-call set-up is not a step's cost
    reads = our_reads(step)
    assert_all_ranks(
        [f"{len(reads)} host reads in the adapters: {sorted(set(reads))}"] if reads else []
    )


def test_the_count_can_fail(layout, monkeypatch):
    """A read in an adapted layer's forward, and one in backward, are seen (the check is not
    vacuous)."""
    from megatron_multilora.layers import slot_factors
    from megatron_multilora.layers.multi_lora_linear import MultiLoRALinear

    layout()
    torch.manual_seed(0)
    model = mm.apply_multi_lora(
        mm.build_gpt_model(DENSE, calculate_per_token_loss=True), N, DIM, 1.0
    )
    mbs = MicroBatcher(model, N, 64, 1, 0).ready(slot_examples())
    units = agree(mbs, N).loss_units
    active, backward = MultiLoRALinear._active_slots, slot_factors._SlotFactors.backward

    def reading(self):
        float(self.adapters.scale.sum())  # a host read, as a forgotten .item() would be
        return active(self)

    def reading_backward(ctx, grad):
        float(grad.sum())
        return backward(ctx, grad)

    monkeypatch.setattr(MultiLoRALinear, "_active_slots", reading)  # the layer's forward
    monkeypatch.setattr(slot_factors._SlotFactors, "backward", staticmethod(reading_backward))
    reads = our_reads(lambda: schedule.per_slot_results(model, mbs, units))
    forward = [r for r in reads if not r.startswith(BACKWARD)]
    assert_all_ranks(
        [] if forward and len(reads) > len(forward) else [f"injected reads not seen: {reads}"]
    )

"""Per-slot optimizer: schedules, fp32 masters for bf16 adapters, clipping, state round trip."""

import math

import pytest
import torch

from megatron_multilora.training.config import AdapterJob
from megatron_multilora.training.step.slot_optimizer import (
    SlotOptimizer,
    lr_factor,
    slot_grad_norms,
)


def slot_grad_norm(params):
    return slot_grad_norms({0: params})[0]


def job(**kw) -> AdapterJob:
    return AdapterJob(name="j", dataset="-", **{"lr": 0.1, "warmup_steps": 2, **kw})


@pytest.mark.parametrize(
    "schedule,at_half,at_end",
    [("constant", 1.0, 1.0), ("linear", 0.55, 0.1), ("cosine", 0.55, 0.1)],
)
def test_lr_schedules(schedule, at_half, at_end):
    j = job(schedule=schedule, min_lr_ratio=0.1)
    assert [lr_factor(s, j, 12) for s in (0, 1)] == [0.5, 1.0]  # warmup
    assert lr_factor(7, j, 12) == pytest.approx(at_half)
    assert lr_factor(12, j, 12) == pytest.approx(at_end)


def test_bf16_slot_steps_fp32_masters_and_clips():
    params = [torch.nn.Parameter(torch.ones(4, 3, dtype=torch.bfloat16))]
    opt = SlotOptimizer(params, job(grad_clip=1.0, warmup_steps=0, schedule="constant"), 10)
    assert opt.masters[0].dtype == torch.float32 and opt.masters[0] is not params[0]
    params[0].grad = torch.full((4, 3), 3.0, dtype=torch.bfloat16)
    norm = slot_grad_norm(params)
    assert norm == pytest.approx(math.sqrt(12 * 9), rel=1e-3)
    opt.step(norm)
    # AdamW's first step moves every weight by ~lr whatever the (clipped) gradient scale
    assert torch.allclose(params[0].float(), torch.full((4, 3), 1.0 - 0.1 - 0.1 * 0.01), atol=1e-2)
    assert params[0].dtype == torch.bfloat16 and opt.masters[0].grad is None
    exp_avg = opt.state_of(params[0], "exp_avg")
    assert torch.allclose(
        exp_avg, torch.full((4, 3), 0.1 * 3.0 / norm)
    )  # clipped grad * (1 - beta1)
    opt.zero_grad()
    assert params[0].grad.abs().sum() == 0

    again = SlotOptimizer(params, job(grad_clip=1.0, warmup_steps=0, schedule="constant"), 10)
    again.load(
        opt.scalar_state(),
        {
            "exp_avg": {params[0]: exp_avg},
            "exp_avg_sq": {params[0]: opt.state_of(params[0], "exp_avg_sq")},
        },
    )
    assert again.scalar_state()["adam_step"] == 1.0
    assert torch.equal(again.state_of(params[0], "exp_avg"), exp_avg)


def test_atomic_folder_write_keeps_the_previous_folder_on_failure(tmp_path):
    from megatron_multilora.atomic_files import write_dir_atomic

    target = tmp_path / "ckpt"
    write_dir_atomic(target, lambda d: (d / "a.txt").write_text("old"))

    def crash(d):
        (d / "a.txt").write_text("half")
        raise RuntimeError("killed mid-save")

    with pytest.raises(RuntimeError):
        write_dir_atomic(target, crash, overwrite=True)
    assert (target / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp folder left
    with pytest.raises(FileExistsError, match="not empty"):
        write_dir_atomic(target, lambda d: None)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reloaded_optimizer_takes_the_same_next_step(schedule, dtype):
    """Stepped k times, saved, loaded into a fresh optimizer: the next lr and step are identical
    (the lr used to be the step-0 warmup value after a load; a bf16 slot's fp32 masters used
    to come back as the bf16 weights' rounding)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=gen).to(dtype))]
    j = job(warmup_steps=3, schedule=schedule, min_lr_ratio=0.1)
    opt = SlotOptimizer(params, j, 10)
    for _ in range(4):
        params[0].grad = torch.randn(4, 3, generator=gen).to(dtype)
        opt.step(slot_grad_norm(params))
    copies = [torch.nn.Parameter(params[0].detach().clone())]
    again = SlotOptimizer(copies, j, 10)
    again.load(
        opt.scalar_state(),
        {m: {copies[0]: opt.state_of(params[0], m)} for m in ("exp_avg", "exp_avg_sq")},
        masters={copies[0]: opt.master_of(params[0])},
    )
    assert again.lr == opt.lr == pytest.approx(0.1 * lr_factor(4, j, 10))
    assert torch.equal(again.master_of(copies[0]), opt.master_of(params[0]))
    grad = torch.randn(4, 3, generator=gen).to(dtype)
    params[0].grad, copies[0].grad = grad.clone(), grad.clone()
    opt.step(slot_grad_norm(params))
    again.step(slot_grad_norm(copies))
    assert torch.equal(copies[0], params[0])
    assert torch.equal(again.master_of(copies[0]), opt.master_of(params[0]))
    assert again.lr == opt.lr

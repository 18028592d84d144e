"""Per-slot optimizers stepping together: each slot as torch's AdamW on it alone, schedules,
clipping norms, fp32 masters for bf16 adapters, state round trips (and earlier checkpoints')."""

import pytest
import torch

import megatron_multilora as mm
from megatron_multilora.training.config import AdapterJob
from megatron_multilora.training.step.grad_sync import SlotGradSync
from megatron_multilora.training.step.slot_adamw import MOMENTS, SlotAdamW
from megatron_multilora.training.step.slot_optimizer import SlotOptimizer, lr_factor
from tests.models import tiny_gpt

CFG = tiny_gpt()


def tiny_model(slots: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = mm.build_gpt_model(CFG, params_dtype=dtype)
    model = mm.apply_multi_lora(model, slots, 8, 16.0, row_init_method="normal")
    for s in range(slots):
        mm.init_adapter_slot(model, s, 8, 16.0)
    return model


def params(model, slot):
    return mm.slot_parameters(model, slot)


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


def _assert_adamw_equal(got: torch.Tensor, want: torch.Tensor, steps: int) -> None:
    """Bit for bit on the CPU. On a GPU torch's AdamW kernels compute ``a + alpha * (b * c)``
    where the stacked update folds the scalar first, an ulp apart per op: within 4 ulps of
    each weight per step taken."""
    if not got.is_cuda:
        assert torch.equal(got, want)
        return
    bound = 4 * steps * torch.finfo(want.dtype).eps
    torch.testing.assert_close(got, want, rtol=bound, atol=bound * float(want.abs().max()))


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "fused_per_slot"])
def test_each_slot_steps_as_torch_adamw_on_that_slot_alone(stacked):
    """Three slots with their own lr, weight decay, clipping and cosine schedule step
    together, one of them idle in the second step: after every step each slot's weights are
    bit for bit those of ``torch.optim.AdamW`` run on that slot's parameters alone with its
    clipped gradients (the single-tensor AdamW for the stacked update, the GPU's; the fused
    one for the fused kernel per slot, the CPU's), and the idle slot is untouched."""
    model = tiny_model(3)
    SlotAdamW.of(model).stacked = stacked
    jobs = [
        job(lr=1e-2, weight_decay=0.01, grad_clip=1.0, warmup_steps=1, schedule="cosine"),
        job(lr=3e-3, weight_decay=0.0, grad_clip=None, warmup_steps=1, schedule="cosine"),
        job(lr=1e-1, weight_decay=0.1, grad_clip=0.5, warmup_steps=1, schedule="cosine"),
    ]
    opts = {s: SlotOptimizer(model, s, jobs[s], 5) for s in range(3)}
    sync = SlotGradSync(SlotAdamW.of(model).rows)
    refs = {s: [torch.nn.Parameter(p.detach().clone()) for p in params(model, s)] for s in range(3)}
    torch_adamw = {
        s: torch.optim.AdamW(
            refs[s], lr=jobs[s].lr, weight_decay=jobs[s].weight_decay, fused=not stacked
        )
        for s in range(3)
    }
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        stepping = [0, 2] if step == 1 else [0, 1, 2]
        for s in range(3):
            for p in params(model, s):
                p.main_grad.copy_(torch.randn(p.shape, generator=gen) * (10 if s == 2 else 1))
        norms = sync.norms().tolist()
        grads = {s: [p.main_grad.clone() for p in params(model, s)] for s in range(3)}
        idle = [p.detach().clone() for p in params(model, 1)]
        lrs = {s: opts[s].lr for s in stepping}
        SlotAdamW.of(model).step({s: opts[s].update(norms[s]) for s in stepping})
        if step == 1:
            assert all(torch.equal(a, b) for a, b in zip(idle, params(model, 1)))
        for s in stepping:
            clip = jobs[s].grad_clip
            coef = min(1.0, clip / (norms[s] + 1e-6)) if clip else 1.0
            for group in torch_adamw[s].param_groups:
                group["lr"] = lrs[s]
            for ref, g in zip(refs[s], grads[s]):
                ref.grad = g * coef
            torch_adamw[s].step()
        for s in range(3):
            for ref, p in zip(refs[s], params(model, s)):
                _assert_adamw_equal(p.detach(), ref.detach(), step + 1)
    assert [opts[s].lr for s in range(3)] == [
        jobs[s].lr * lr_factor(steps, jobs[s], 5) for s, steps in ((0, 4), (1, 3), (2, 4))
    ]


def test_the_clipping_norm_is_each_slots_whole_gradient():
    model = tiny_model(2)
    sync = SlotGradSync(SlotAdamW.of(model).rows)
    gen = torch.Generator().manual_seed(2)
    for s in range(2):
        for p in params(model, s):
            p.main_grad.copy_(torch.randn(p.shape, generator=gen))
    want = [torch.cat([p.main_grad.flatten() for p in params(model, s)]).norm() for s in range(2)]
    assert torch.allclose(sync.norms(), torch.stack(want), rtol=1e-6)


def test_bf16_slot_steps_fp32_masters():
    model = tiny_model(2, torch.bfloat16)
    opt = SlotOptimizer(model, 0, job(warmup_steps=0, schedule="constant", weight_decay=0.01), 10)
    first = params(model, 0)[0]
    master = opt.master_of(first)
    assert master.dtype == torch.float32 and first.dtype == torch.bfloat16
    before = master.clone()
    for p in params(model, 0):
        p.main_grad.fill_(3.0)
    SlotAdamW.of(model).step({0: opt.update(1.0)})
    # AdamW's first step moves every weight by ~lr (0.1) whatever the gradient's scale
    assert torch.allclose(master, before * (1 - 0.1 * 0.01) - 0.1, atol=1e-5)
    assert torch.equal(first, master.to(torch.bfloat16))
    assert torch.allclose(opt.state_of(first, "exp_avg"), torch.full_like(master, 0.3))


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
    """Stepped k times, saved, loaded into a fresh optimizer of another model: the next lr
    and step are identical (the lr used to be the step-0 warmup value after a load; a bf16
    slot's fp32 masters used to come back as the bf16 weights' rounding)."""
    gen = torch.Generator().manual_seed(0)
    j = job(warmup_steps=3, schedule=schedule, min_lr_ratio=0.1)
    model = tiny_model(1, dtype)
    opt = SlotOptimizer(model, 0, j, 10)

    def step(model, opt, grads):
        for p, g in zip(params(model, 0), grads):
            p.main_grad.copy_(g)
        SlotAdamW.of(model).step({0: opt.update(1.0)})

    def grads():
        return [torch.randn(p.shape, generator=gen) for p in params(model, 0)]

    for _ in range(4):
        step(model, opt, grads())
    again_model = tiny_model(1, dtype)
    with torch.no_grad():
        for p, q in zip(params(again_model, 0), params(model, 0)):
            p.copy_(q)
    again = SlotOptimizer(again_model, 0, j, 10)
    pairs = list(zip(params(again_model, 0), params(model, 0)))
    again.load(
        opt.scalar_state(),
        {m: {p: opt.state_of(q, m) for p, q in pairs} for m in ("exp_avg", "exp_avg_sq")},
        masters={p: opt.master_of(q) for p, q in pairs},
    )
    assert again.lr == opt.lr == pytest.approx(0.1 * lr_factor(4, j, 10))
    assert all(torch.equal(again.master_of(p), opt.master_of(q)) for p, q in pairs)
    same = grads()
    step(model, opt, same)
    step(again_model, again, same)
    assert all(torch.equal(p, q) for p, q in pairs)
    assert all(torch.equal(again.master_of(p), opt.master_of(q)) for p, q in pairs)
    assert again.lr == opt.lr


def test_an_earlier_checkpoints_optimizer_state_loads():
    """The scalar state of checkpoints written by torch's AdamW and LambdaLR (before the
    slots stepped together) restores the step count and the schedule."""
    model = tiny_model(1)
    j = job(warmup_steps=3, schedule="linear")
    opt = SlotOptimizer(model, 0, j, 10)
    earlier = {
        "adam_step": 4.0,
        "scheduler": {
            "base_lrs": [0.1],
            "last_epoch": 4,
            "verbose": False,
            "_step_count": 5,
            "_get_lr_called_within_step": False,
            "_last_lr": [0.1 * lr_factor(4, j, 10)],
            "lr_lambdas": [None],
        },
    }
    zeros = {m: {p: torch.zeros_like(p) for p in params(model, 0)} for m in MOMENTS}
    opt.load(earlier, zeros)
    assert opt.scalar_state() == {
        "adam_step": 4.0,
        "scheduler": {"base_lrs": [0.1], "last_epoch": 4, "_last_lr": [0.1 * lr_factor(4, j, 10)]},
    }
    opt.update(1.0)
    assert opt.lr == 0.1 * lr_factor(5, j, 10)

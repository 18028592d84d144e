"""The paged adapter table: 12 adapters taking turns in 4 device slots train bit for bit as
each alone in a slot of its own; a page holds every row of the adapter (weights, fp32
masters of a bf16 adapter, moments, a client's accumulated gradients) and nothing of any
other slot; the least recently used adapter is the one paged out.

Every example is as long as a micro-batch, so each micro-batch holds one example and every
GEMM of an adapter runs the same calls on the same rows paged or alone: the bits are equal
by construction on any CPU."""

import random

import pytest
import torch

import megatron_multilora as mm
from megatron_multilora.training.config import AdapterJob
from megatron_multilora.training.objectives.registry import DEFAULT
from megatron_multilora.training.runtime import start_job
from megatron_multilora.training.step.adapter_table import AdapterTable, TableFull
from megatron_multilora.training.step.slot_adamw import MOMENTS
from megatron_multilora.training.step.slot_step import SlotStep, SlotWork
from tests.models import random_example, tiny_gpt

CFG = tiny_gpt()
LENGTH = 24  # every example's tokens: one micro-batch each


def _model(
    slots: int, dtype: torch.dtype = torch.float32, base: dict | None = None
) -> list[torch.nn.Module]:
    """The tiny GPT with ``slots`` slots (``base``: its frozen weights, which a second build
    on a GPU does not repeat: megatron draws them from its tensor-parallel stream there)."""
    torch.manual_seed(0)
    model = mm.build_gpt_model(CFG, params_dtype=dtype, calculate_per_token_loss=True)
    if base is not None:
        model.load_state_dict(base, strict=False)
    return [mm.apply_multi_lora(model, slots, 8, 16.0)]


def _base(model: list[torch.nn.Module]) -> dict:
    with mm.hide_adapters(model):
        return {k: v for k, v in model[0].state_dict().items() if torch.is_tensor(v)}


def _jobs(n: int) -> list[AdapterJob]:
    return [
        AdapterJob(
            name=f"job{i}",
            dataset="-",
            rank=(4, 8)[i % 2],
            lr=1e-3 * (1 + i % 3),
            warmup_steps=i % 3,
            schedule=("constant", "linear", "cosine")[i % 3],
            grad_clip=0.05 if i % 4 == 0 else 1.0,
        )
        for i in range(n)
    ]


def _batches(job: AdapterJob, steps: int) -> list[list]:
    gen = torch.Generator().manual_seed(int(job.name[3:]))
    return [
        [random_example(LENGTH, CFG.vocab_size, gen) for _ in range(1 + int(job.name[3:]) % 3)]
        for _ in range(steps)
    ]


def _state(model, slot: int, optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for i, p in enumerate(mm.slot_parameters(model, slot)):
        out[f"{i}/value"] = p.detach().clone()
        out[f"{i}/master"] = optimizer.master_of(p).clone()
        for m in MOMENTS:
            out[f"{i}/{m}"] = optimizer.state_of(p, m).clone()
    return out


def _alone(
    job: AdapterJob, batches: list[list], dtype: torch.dtype, base: dict
) -> dict[str, torch.Tensor]:
    model = _model(1, dtype, base)
    step = SlotStep(model, 1, LENGTH, 1, 0)
    optimizer = start_job(model, 0, job, len(batches), CFG)
    for items in batches:
        step.train({0: SlotWork(items, DEFAULT(), optimizer)})
    return _state(model, 0, optimizer)


def turns_and_alone(dtype: torch.dtype) -> tuple[AdapterTable, list[tuple[dict, dict]]]:
    """12 adapters taking random turns in 4 slots for 3 steps each; each adapter's state
    then, and its state trained alone in a model of one slot (weights, masters, moments)."""
    jobs, steps, slots = _jobs(12), 3, 4
    batches = {job.name: _batches(job, steps) for job in jobs}
    model = _model(slots, dtype)
    base = _base(model)
    step = SlotStep(model, slots, LENGTH, 1, 0)
    table = AdapterTable(step)
    done = {job.name: 0 for job in jobs}
    order = random.Random(0)
    while any(n < steps for n in done.values()):
        waiting = [job for job in jobs if done[job.name] < steps]
        turn = order.sample(waiting, min(slots, len(waiting)))
        placed = table.place([job.name for job in turn])
        for job in turn:
            if job.name not in table.optimizers:  # its first turn: it starts in its slot
                table.bind(job.name, start_job(model, placed[job.name], job, steps, CFG))
        step.train(
            {
                placed[job.name]: SlotWork(
                    batches[job.name][done[job.name]], DEFAULT(), table.optimizers[job.name]
                )
                for job in turn
            }
        )
        for job in turn:
            done[job.name] += 1
    assert table.stats.pages_out >= len(jobs) - slots and table.stats.pages_in > 0
    pairs = []
    for job in jobs:
        slot = table.place([job.name])[job.name]
        got = _state(model, slot, table.optimizers[job.name])
        pairs.append((got, _alone(job, batches[job.name], dtype, base)))
    return table, pairs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_adapters_taking_turns_in_fewer_slots_train_bit_for_bit_as_each_alone(dtype):
    _, pairs = turns_and_alone(dtype)
    for got, want in pairs:
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key


def test_least_recently_used_is_paged_out_and_a_page_is_the_adapters_own_rows():
    model = _model(2)
    step = SlotStep(model, 2, LENGTH, 1, 0)
    table = AdapterTable(step)
    jobs = _jobs(3)
    for job in jobs[:2]:
        table.bind(job.name, start_job(model, table.place([job.name])[job.name], job, 1, CFG))
    table.place([jobs[0].name])  # job1 is now the least recently used
    rows = step.adamw.rows
    row = {name: m[1].clone() for name, m in rows.values.items()}
    moment = step.adamw.moments["exp_avg"]["dense"][1].clone()
    bank = mm.multi_lora_modules(model)[0].adapters
    saved = (bank.ranks[1], bank.alphas[1], bank.rates[1])
    slot = table.place([jobs[2].name])[jobs[2].name]
    assert table.slot_of(jobs[1].name) is None and table.slot_of(jobs[0].name) is not None
    assert slot == 1 and jobs[1].name in table.pages
    page = table.pages[jobs[1].name]
    assert torch.equal(page.rows["values/dense"], row["dense"])
    assert torch.equal(page.rows["exp_avg/dense"], moment)
    assert page.rows["values/dense"].shape == (rows.kinds["dense"].width,)  # one slot's row
    assert page.banks[0] == saved and saved[0] == jobs[1].rank
    assert "grad/dense" not in page.rows  # nothing accumulated
    for layer in mm.multi_lora_modules(model):  # the freed slot is blank: alpha 0
        assert layer.adapters.alphas[1] == 0.0 and float(layer.adapters.scale[1]) == 0.0
    assert len(table) == 3
    with pytest.raises(TableFull, match="3 adapters cannot be resident at once in 2"):
        table.place([job.name for job in jobs])
    table.forget(jobs[1].name)
    assert jobs[1].name not in table and len(table) == 2


def test_accumulated_gradients_travel_with_the_page():
    """A service client's forward_backward gradients wait in its slot until optim_step:
    paged out and in (to another slot), its step equals the step without paging."""
    job = _jobs(1)[0]
    items = _batches(job, 1)[0]
    results = []
    for paged in (False, True):
        model = _model(2)
        step = SlotStep(model, 2, LENGTH, 1, 0)
        table = AdapterTable(step)
        slot = table.place(["client"])["client"]
        table.bind("client", start_job(model, slot, job, 1, CFG))
        step.train({slot: SlotWork(items, DEFAULT())})  # accumulates, no optimizer step
        if paged:
            table.place(["other"])
            table.page_out("client")
            assert table.pages["client"].accumulated
            assert table.place(["x"]) == {"x": 0}  # the client's old slot
            slot = table.place(["client"])["client"]  # "other", least recent, makes room
            assert slot == 1 and "other" in table.pages
        _, skipped = step.apply({slot: table.optimizers["client"]})
        assert not skipped
        results.append(_state(model, slot, table.optimizers["client"]))
    for key in results[0]:
        assert torch.equal(results[1][key], results[0][key]), key

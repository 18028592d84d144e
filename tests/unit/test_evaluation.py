"""Greedy generation with megatron's KV cache gives the tokens of re-running the prefix,
with finished sequences leaving the batch."""

import pytest
import torch

import megatron_multilora as mm
from megatron_multilora.training.step import generation
from tests.models import tiny_gpt

CFG = tiny_gpt()
N_SLOTS = 4


def model_with_distinct_adapters() -> torch.nn.Module:
    """Slots 0-2 hold random adapters of different ranks (large enough to change the
    generations), slot 3 stays free."""
    torch.manual_seed(1)  # a model whose generations meet the test's conditions on eos
    model = mm.apply_multi_lora(mm.build_gpt_model(CFG), N_SLOTS, 8, alpha=1.0)
    for slot, rank in enumerate([8, 4, 8]):
        mm.init_adapter_slot(model, slot, rank=rank, alpha=2.0 * rank)
        for p in mm.slot_parameters(model, slot):
            p.data.normal_(0, 0.3)
    return model


def prompts() -> list[tuple[int, list[int]]]:
    """Unsorted slots, prompt lengths 1-7, slot 3 unused."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(9):
        length = 1 + (i * 3) % 7
        out.append(((2 * i) % 3, torch.randint(3, 64, (length,), generator=gen).tolist()))
    return out


def generate(model, items, eos_id: int, kv_cache: bool) -> list[list[int]]:
    return generation.greedy_generate(
        model,
        items,
        N_SLOTS,
        max_new_tokens=6,
        eos_id=eos_id,
        pad_multiple=1,
        pad_id=0,
        kv_cache=kv_cache,
    )


def test_kv_cache_generates_the_same_tokens_as_the_uncached_path(monkeypatch):
    model = model_with_distinct_adapters()
    items = prompts()
    contexts, rows = [], []  # the cached path must really run with an inference context
    forward = model.forward
    monkeypatch.setattr(
        model,
        "forward",
        lambda *a, **kw: (
            contexts.append(kw.get("inference_context")),
            rows.append((a[0] if a else kw["input_ids"]).size(0)),
            forward(*a, **kw),
        )[2],
    )
    never_eos = generate(model, items, eos_id=-1, kv_cache=False)
    assert all(len(g) == 6 for g in never_eos)
    assert len({tuple(g) for g in never_eos}) > 1
    # An eos that some sequences produce mid-way: they stop early, the others run to the end.
    eos = never_eos[0][2]
    uncached = generate(model, items, eos, kv_cache=False)
    assert not any(contexts)
    rows.clear()
    cached = generate(model, items, eos, kv_cache=True)
    assert all(c is not None for c in contexts[-3:])
    assert cached == uncached
    # Decode steps fed every sequence at first, fewer once some had finished.
    decode = rows[-(len(rows) - len({s for s, _ in items})) :]
    assert decode[0] == len(items) and decode[-1] < len(items)
    assert {len(g) for g in uncached} >= {2, 6}
    # Same slot, same prompt -> the same tokens; another slot's adapter -> other tokens.
    assert cached == generate(model, items, eos, kv_cache=True)
    others = generate(model, [((s + 1) % 3, p) for s, p in items], -1, kv_cache=True)
    assert others != never_eos


def test_given_up_prompts_stop_there_and_leave_the_others_alone():
    model = model_with_distinct_adapters()
    items = prompts()
    full = generate(model, items, eos_id=-1, kv_cache=True)
    asked = []

    def give_up(i: int, tokens: list[int]) -> bool:  # odd prompts: after their second token
        asked.append(i)
        return i % 2 == 1 and len(tokens) >= 2

    for kv_cache in (True, False):
        got = generation.greedy_generate(
            model, items, N_SLOTS, 6, -1, 1, 0, kv_cache=kv_cache, give_up=give_up
        )
        assert got == [g[:2] if i % 2 else g for i, g in enumerate(full)]
    assert set(asked) == set(range(len(items)))


def test_the_tables_base_row_is_the_base_model_whatever_its_slot_held(tmp_path):
    """The final table fills the slots with its rows in order, the base model's first: a slot
    that still holds a job's adapter from training is cleared for it (it gave that adapter's
    row as the base's when a run stopped at trainer.max_steps)."""
    import types

    from megatron_multilora.checkpoint.adapter_files import export_adapter
    from megatron_multilora.data.datasets import Example
    from megatron_multilora.training.objectives.sft import SFT
    from megatron_multilora.training.report.tables import AdapterTaskEval
    from megatron_multilora.training.step.slot_step import SlotStep

    torch.manual_seed(1)
    model = mm.apply_multi_lora(
        mm.build_gpt_model(CFG, calculate_per_token_loss=True), N_SLOTS, 8, alpha=1.0
    )
    for slot in (0, 1):
        mm.init_adapter_slot(model, slot, rank=8, alpha=16.0)  # max rank: no padding rows
        for p in mm.slot_parameters(model, slot):
            p.data.normal_(0, 0.3)
    folder = export_adapter(model, 1, tmp_path / "one", {})
    gen = torch.Generator().manual_seed(2)
    examples = [
        Example(tuple(torch.randint(3, 64, (6,), generator=gen).tolist()), (False,) + (True,) * 4)
        for _ in range(3)
    ]
    task = types.SimpleNamespace(name="t", eval=examples, eval_records=[], objective=SFT())
    tokenizer = types.SimpleNamespace(bos_id=1, eos_id=2, pad_id=0)
    ev = AdapterTaskEval(SlotStep(model, N_SLOTS, 64, 1, tokenizer.pad_id), tokenizer, 2)
    base = ev.evaluate({3: task})[0][3]["loss"]  # slot 3 is free
    held, one = (ev.evaluate({s: task})[0][s]["loss"] for s in (0, 1))
    assert abs(held - base) > 1e-3  # slot 0 really holds an adapter that changes the loss

    tables = ev.tables([None, folder], [task])
    assert tables.losses[0][0] == pytest.approx(base, rel=1e-6)
    assert tables.losses[1][0] == pytest.approx(one, rel=1e-6)

"""The adapter x task tables at DP=2: each data-parallel rank evaluates and generates a share
of every task (losses summed over the group, exact-match counts too), giving one process's
tables; under TP and PP the generations the held-out pass decides are the generated ones."""

import types

import pytest
import torch
from megatron.core import parallel_state

from megatron_multilora.data.datasets import Example
from megatron_multilora.models.gpt import build_model_chunks
from megatron_multilora.training.objectives.sft import SFT
from megatron_multilora.training.report.tables import AdapterTaskEval
from megatron_multilora.training.step import generation
from megatron_multilora.training.step.slot_step import SlotStep
from tests.distributed.conftest import assert_all_ranks
from tests.distributed.harness import N, build
from tests.models import tiny_gpt
from tests.unit.test_known_generations import CFG as KNOWN_CFG
from tests.unit.test_known_generations import adapted, known_against_generated

CFG = tiny_gpt(
    gated_linear_unit=True,
)


class Digits:
    """Token i + 3 is digit character i % 10: answers are strings of digits."""

    bos_id, eos_id, pad_id = 1, 2, 0

    def encode(self, text: str) -> list[int]:
        return [3 + int(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(str((i - 3) % 10) for i in ids if i >= 3)


def task(name: str, seed: int, n: int) -> types.SimpleNamespace:
    """``n`` held-out examples and prompt records (their answers are filled in by the test)."""
    gen = torch.Generator().manual_seed(seed)
    examples, records = [], []
    for i in range(n):
        tokens = torch.randint(3, 13, (4 + i % 5,), generator=gen).tolist()
        examples.append(Example(tuple(tokens), tuple([False] + [True] * (len(tokens) - 2))))
        records.append({"prompt": "".join(str(t - 3) for t in tokens[:3]), "completion": "?"})
    return types.SimpleNamespace(name=name, eval=examples, eval_records=records, objective=SFT())


def tables_of(model, tasks):
    ev = AdapterTaskEval(SlotStep(model, N, 40, 1, Digits().pad_id), Digits(), 3)
    cells = [(slot, t) for t in tasks for slot in range(N)]
    return (
        {(s, t.name): ev.evaluate({s: t})[0][s]["loss"] for s, t in cells},
        ev._cell_accuracy(cells, {}),
    )


def test_dp2_tables_match_one_process(layout, monkeypatch):
    tasks = [task("a", 0, 7), task("b", 1, 4)]
    layout()
    failures: list[str] = []
    if parallel_state.get_data_parallel_world_size() != 2:
        failures.append("the scenario needs two data-parallel ranks")
    # Per-token loss: the evaluation normalises each adapter's loss itself.
    model = build(CFG, ddp=False, calculate_per_token_loss=True)
    # Answers: one process's generations for every other prompt, so the counts must add up.
    prompts = [
        (slot, [1] + Digits().encode(r["prompt"]))
        for t in tasks
        for slot in range(N)
        for r in t.eval_records
    ]
    outs = generation.greedy_generate(model, prompts, N, 3, 2, 1, 0)
    k = 0
    for t in tasks:
        for slot in range(N):
            for i, r in enumerate(t.eval_records):
                if i % 2 == 0 and slot == 0:
                    r["completion"] = Digits().decode(outs[k])
                k += 1

    with monkeypatch.context() as alone:  # the reference: every rank evaluates everything
        alone.setattr(parallel_state, "get_data_parallel_world_size", lambda *a, **k: 1)
        alone.setattr(parallel_state, "get_data_parallel_rank", lambda *a, **k: 0)
        want_losses, want_accuracy = tables_of(model, tasks)

    seen: list[int] = []
    real = generation.greedy_generate

    def counting(model, prompts, *args, **kwargs):
        seen.append(len(prompts))
        return real(model, prompts, *args, **kwargs)

    monkeypatch.setattr(generation, "greedy_generate", counting)
    losses, accuracy = tables_of(model, tasks)
    monkeypatch.undo()
    share = len(prompts[parallel_state.get_data_parallel_rank() :: 2])
    if seen != [share]:
        failures.append(f"this rank generated {seen} prompts of {len(prompts)}: want {share}")
    for cell, want in want_losses.items():
        if abs(losses[cell] - want) > 1e-5 * max(1.0, abs(want)):
            failures.append(f"loss {cell}: {losses[cell]} != one process's {want}")
    if accuracy != want_accuracy:
        failures.append(f"accuracy {accuracy} != one process's {want_accuracy}")
    if not 0 < want_accuracy[(0, "a")] < 1:
        failures.append(f"slot 0 on task a: accuracy {want_accuracy[(0, 'a')]}, want in (0, 1)")
    assert_all_ranks(failures)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_known_generations_are_the_generated_ones_under_tp_and_pp(layout, tp, pp):
    """The held-out pass's clear choices come from every vocabulary shard (TP: the best two
    of each) and from the last stage (PP: broadcast to every stage), and decide what
    generating every prompt in the same layout gives."""
    layout(tp=tp, pp=pp)
    chunks = build_model_chunks(KNOWN_CFG, calculate_per_token_loss=True)
    failures, *_ = known_against_generated(adapted(chunks if pp > 1 else chunks[0]))
    assert_all_ranks(failures)

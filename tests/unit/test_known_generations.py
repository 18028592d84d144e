"""Greedy generations known from the held-out pass (training/report/tables.py): the
teacher-forced choices at an example's completion positions give greedy decoding's tokens as
far as they follow the reference and where they first leave it, so the tables decode only
the prompts that pass leaves open, with the accuracy of decoding every prompt."""

import dataclasses
import types

import pytest
import torch

import megatron_multilora as mm
from megatron_multilora.data.datasets import Example
from megatron_multilora.models.loss_rows import CLEAR_MARGINS, clear_choices, compute_dtype
from megatron_multilora.training.objectives.sft import SFT
from megatron_multilora.training.report.tables import AdapterTaskEval
from megatron_multilora.training.step import generation
from megatron_multilora.training.step.slot_step import SlotStep
from tests.models import tiny_gpt

EOS = 2
CFG = tiny_gpt()
N_SLOTS = 3


class Digits:
    """Token i + 3 is digit character i % 10: answers are strings of digits."""

    bos_id, eos_id, pad_id = 1, EOS, 0

    def encode(self, text: str) -> list[int]:
        return [3 + int(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(str((i - 3) % 10) for i in ids if i >= 3)


def never(_: int, tokens: list[int]) -> bool:
    return False


@pytest.mark.parametrize(
    "reference, choices, limit, give_up, want",
    [
        ([5, 6, EOS], [5, 6, EOS], 9, never, [5, 6]),  # follows the reference to its eos
        ([5, 6, EOS], [5, EOS, 7], 9, never, [5]),  # leaves it with eos: ends there
        ([5, 6, EOS], [5, 7, 7], 9, lambda _, t: t[-1] == 7, [5, 7]),  # leaves it, given up
        ([5, 6, EOS], [5, 7, 7], 9, never, None),  # leaves it and would go on: unknown
        ([5, 6, EOS], [5, -1, EOS], 9, never, None),  # an unclear choice: unknown
        ([5, 6, 7, EOS], [5, 6, -1, 3], 2, never, [5, 6]),  # the length limit comes first
        ([5, 6, 7, EOS], [5, -1, -1, 3], 0, never, []),  # nothing to generate
        ([5, 6], [5, 6], 9, never, None),  # the reference ends before generation would
        ([5, 6, EOS], [5, 6, 9], 9, never, None),  # a non-eos choice past the reference's words
    ],
)
def test_forced_greedy_follows_the_rules_of_a_generation(reference, choices, limit, give_up, want):
    assert generation.forced_greedy(reference, choices, limit, EOS, give_up) == want


def test_a_choice_is_clear_only_ahead_of_its_runner_up_by_the_precisions_margin():
    logits = torch.tensor(
        [
            [0.0, 3.0, 2.995, 1.0],  # near-tie in fp32
            [0.0, 3.0, 2.9, 1.0],  # clear in fp32, not in bf16
            [5.0, 3.0, 2.9, 1.0],
        ]
    )  # clear in both
    assert clear_choices(logits, CLEAR_MARGINS[torch.float32]).tolist() == [-1, 1, 0]
    assert clear_choices(logits, CLEAR_MARGINS[torch.bfloat16]).tolist() == [-1, -1, 0]
    fp32 = mm.build_gpt_model(CFG)
    assert compute_dtype(fp32) == torch.float32
    assert compute_dtype(mm.build_gpt_model(CFG, cpu_gemm_dtype=torch.bfloat16)) == torch.bfloat16
    fp32.config.bf16 = True
    assert compute_dtype(fp32) == torch.bfloat16


def adapted(model):
    """``model`` (or its pipeline chunks) with distinct random adapters in every slot, and
    logits a few units apart as a trained model's (megatron's initialisation leaves them
    ~1e-4 apart: every choice a near-tie)."""
    chunks = model if isinstance(model, list) else [model]
    torch.manual_seed(3)
    mm.apply_multi_lora(model, N_SLOTS, 8, alpha=1.0)
    for slot in range(N_SLOTS):
        mm.init_adapter_slot(model, slot, rank=8, alpha=16.0)
        for p in mm.slot_parameters(model, slot):
            p.data.normal_(0, 0.3)
    for chunk in chunks:
        if chunk.post_process:
            chunk.output_layer.weight.data.mul_(100.0)
    return model


def own_and_other_tasks(model) -> list:
    """Task "own": each record's completion is slot 0's greedy output (hits, in every slot
    whose output it is too); task "other": answers no generation reaches ("?")."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 13, (2 + i % 4,), generator=gen).tolist() for i in range(12)]
    outs = generation.greedy_generate(model, [(0, [1] + p) for p in prompts], N_SLOTS, 4, EOS, 1, 0)
    tasks = []
    for name, tails in (("own", outs), ("other", [[3 + i % 10, 4] for i in range(12)])):
        examples, records = [], []
        for prompt, tail in zip(prompts, tails):
            tokens = [1] + prompt + tail + [EOS]
            examples.append(
                Example(tuple(tokens), (False,) * len(prompt) + (True,) * (len(tail) + 1))
            )
            records.append(
                {
                    "prompt": Digits().decode(prompt),
                    "completion": Digits().decode(tail) if name == "own" else "?",
                }
            )
        tasks.append(
            types.SimpleNamespace(name=name, eval=examples, eval_records=records, objective=SFT())
        )
    return tasks


def known_against_generated(model) -> tuple[list[str], AdapterTaskEval, list, dict, int]:
    """Every slot on both tasks: what the held-out pass decides against generating every
    prompt. Returns the disagreements, the evaluator, the cells, what is known and the
    number of prompts; asserts nothing, so that multi-process tests gather the failures."""
    tasks = own_and_other_tasks(model)
    ev = AdapterTaskEval(SlotStep(model, N_SLOTS, 64, 1, Digits().pad_id), Digits(), 4)
    cells = [(slot, task) for task in tasks for slot in range(N_SLOTS)]
    known = {}
    for task in tasks:
        known.update(ev.evaluate({slot: task for slot in range(N_SLOTS)})[1])
    records = [(slot, task, r) for slot, task in cells for r in task.eval_records]
    every = generation.greedy_generate(
        model,
        [(slot, [1] + Digits().encode(r["prompt"])) for slot, _, r in records],
        N_SLOTS,
        4,
        EOS,
        1,
        0,
    )
    decided = [k for slot, task in cells for k in known[(slot, task.name)]]
    failures, hits, misses = [], 0, 0
    for out, (slot, task, record), k in zip(every, records, decided):
        if k is None:
            continue
        # Known tokens are the generation's, up to where it is decided (given up: a miss).
        hit = Digits().decode(k) == record["completion"]
        if out[: len(k)] != k or hit != (Digits().decode(out) == record["completion"]):
            failures.append(f"slot {slot} on {task.name} {record}: known {k}, generated {out}")
        hits, misses = hits + hit, misses + (not hit)
    if hits < 6 or misses < 12:  # both kinds really decided
        failures.append(f"decided {hits} hits and {misses} misses of {len(decided)} prompts")
    return failures, ev, cells, known, len(decided)


@pytest.mark.parametrize(
    "cfg", [CFG, dataclasses.replace(CFG, num_moe_experts=4)], ids=["dense", "moe"]
)  # MoE: decoded without the KV cache
def test_the_tables_accuracy_is_every_prompts_generated_one(monkeypatch, cfg):
    model = adapted(mm.build_gpt_model(cfg, calculate_per_token_loss=True))
    failures, ev, cells, known, prompts = known_against_generated(model)
    assert not failures, failures

    seen: list[int] = []
    real = generation.greedy_generate
    monkeypatch.setattr(
        generation,
        "greedy_generate",
        lambda m, p, *a, **k: seen.append(len(p)) or real(m, p, *a, **k),
    )
    with_known = ev._cell_accuracy(cells, known)
    undecided = sum(k is None for ks in known.values() for k in ks)
    assert seen == ([undecided] if undecided else [])
    seen.clear()
    assert ev._cell_accuracy(cells, {}) == with_known
    assert seen == [prompts]
    assert 0 < with_known[(0, "own")] and with_known[(0, "other")] == 0.0

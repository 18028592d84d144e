"""Kernel launches and host syncs per step, counted as aten ops and host reads under
torch.profiler (``benchmarks/launches.py``; deterministic, so they are held as tests): the
trainer step's ops and host reads do not grow with the number of slots (64 slots at most
1.25x one slot's ops, at most 8 reads), the optimizer's ops are the same for 1 and 64
slots, and the SmolLM2-shaped fwd+bwd with 4 slots costs at most 1.3x the frozen base's ops
and reads nothing back beyond the base's own."""

import pytest
import torch

from benchmarks import launches
from benchmarks.settings import parse_settings
from benchmarks.workloads import build_model, model_config, start_jobs
from megatron_multilora.training.step.slot_adamw import SlotAdamW

SETTINGS, _ = parse_settings(["--quick"])


@pytest.fixture(scope="module")
def step_counts():
    torch.manual_seed(0)
    return {n: launches.count(fn) for n, fn in launches.trainer_steps(SETTINGS).items()}


@pytest.fixture(scope="module")
def width_counts():
    return {name: launches.count(fn) for name, fn in launches.width_steps(SETTINGS).items()}


def test_the_counter_sees_host_reads_and_ops():
    """The counter itself can fail: a step that reads a value back is seen, and ops count."""
    x = torch.ones(4)
    reads = launches.count(lambda: [float(x.sum()) for _ in range(3)])
    assert reads.host_reads == 3 and reads.ops >= 6


def test_trainer_step_host_reads_do_not_grow_with_slots(step_counts):
    reads = {n: c.host_reads for n, c in step_counts.items()}
    assert max(reads.values()) <= 8, reads
    assert len(set(reads.values())) == 1, reads


def test_64_slot_trainer_step_costs_at_most_a_quarter_more_ops(step_counts):
    assert step_counts[64].ops <= 1.25 * step_counts[1].ops


def test_the_optimizer_step_has_the_same_ops_for_1_and_64_slots():
    cfg = model_config("dense", SETTINGS)
    model = build_model(cfg, SETTINGS, 64)
    adamw = SlotAdamW.of(model)
    adamw.stacked = True  # the GPU's update
    opts = start_jobs(model, SETTINGS, cfg, 10, 64)
    counts = {
        n: launches.count(lambda n=n: adamw.step({s: opts[s].update(1.0) for s in range(n)}))
        for n in (1, 64)
    }
    assert counts[1] == counts[64] and counts[1].host_reads == 0, counts


def test_rows_14_report_every_count(step_counts, width_counts):
    counts = {f"{n} slots": c for n, c in step_counts.items()} | width_counts
    rows = launches.launch_rows(counts)
    assert [r.id for r in rows] == ["14a", "14b", "14c", "14d", "14e"]
    assert all(r.a_value > 0 and r.b_value > 0 and r.ratio > 0 for r in rows)


def test_adapted_fwd_bwd_reads_nothing_back(width_counts):
    assert width_counts["lora"].host_reads <= 4, width_counts
    assert width_counts["lora"].host_reads == width_counts["base"].host_reads


def test_smollm2_shaped_fwd_bwd_costs_at_most_30_percent_more_ops(width_counts):
    assert width_counts["lora"].ops <= 1.3 * width_counts["base"].ops

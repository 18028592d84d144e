"""The benchmark package runs end to end (``python -m benchmarks --quick``) and reports every
row with positive figures; the slow tier (``-m slow``): CI runs it, a quick local loop may
leave it out with ``-m "not slow"``."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMED_ROWS = ["1a", "2a", "3a", "1b", "2b", "3b", "1c", "2c", "1d", "2d", "4", "5"]
TP_ROWS = ["6a", "6b"]
PP_ROWS = ["7a", "7b"]
SCALE_ROWS = ["8a", "8b", "8c", "9"]  # after the TP and PP sections
POST_ROWS = ["11a", "11b"]

pytestmark = pytest.mark.slow


def benchmark(*args: str, out_dir: Path) -> None:
    # One thread: two threads stall badly when other processes load the cores.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "--quick",
            "--threads",
            "1",
            "--out-dir",
            str(out_dir),
            *args,
        ],
        check=True,
        cwd=REPO,
        timeout=240,
        stdout=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> Path:
    """The main job's data (scripts/make_demo_data.py: the demo tasks and the tiny Llama),
    written once for the tests that read it."""
    data = tmp_path_factory.mktemp("demo")
    subprocess.run(
        [sys.executable, "scripts/make_demo_data.py", "--out-dir", str(data)],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=120,
    )
    return data


def assert_measured(row: dict, markdown: str) -> None:
    for key in ("a_value", "b_value", "ratio"):
        assert math.isfinite(row[key]) and row[key] > 0, (row["id"], key, row[key])
    assert f"| {row['id']} |" in markdown and f"- **{row['id']}**:" in markdown


def test_quick_benchmark_writes_every_row(tmp_path):
    benchmark("--skip-tp", "--skip-pp", out_dir=tmp_path)
    report = json.loads((tmp_path / "cpu.json").read_text())
    markdown = (tmp_path / "cpu.md").read_text()
    rows = {row["id"]: row for row in report["rows"]}
    assert list(rows) == TIMED_ROWS + TP_ROWS + PP_ROWS + SCALE_ROWS + POST_ROWS
    for row_id in TIMED_ROWS + SCALE_ROWS + POST_ROWS:
        assert_measured(rows[row_id], markdown)
    for row_id, flag in [(r, "--skip-tp") for r in TP_ROWS] + [(r, "--skip-pp") for r in PP_ROWS]:
        assert rows[row_id]["skipped"].startswith(f"skipped: {flag}")
        assert f"| {row_id} |" in markdown
    meta = report["meta"]
    assert meta["hardware"]["cpu_cores"] >= 1 and meta["versions"]["torch"]
    assert meta["settings"]["quick"] and meta["settings"]["dtype"] == "fp32"


def test_quick_pp_section_alone(tmp_path):
    """--only pp: PP=1 here, PP=2 and DP=2 in 2 processes; the layouts train alike; the full
    report is left alone."""
    benchmark("--only", "pp", out_dir=tmp_path)
    assert not (tmp_path / "cpu.json").exists()
    report = json.loads((tmp_path / "cpu-only-pp.json").read_text())
    markdown = (tmp_path / "cpu-only-pp.md").read_text()
    rows = {row["id"]: row for row in report["rows"]}
    assert list(rows) == PP_ROWS and report["meta"]["sections"] == ["pp"]
    for row_id in PP_ROWS:
        row = rows[row_id]
        assert_measured(row, markdown)
        assert "differ by at most" in row["note"]
        assert float(row["note"].split("at most ")[1].split()[0]) < 1e-5, row["note"]
    assert set(report["samples_s"]["trainer step PP"]) == {"PP=2", "DP=2", "PP=1 one process"}


def test_a_failing_section_keeps_the_others(tmp_path):
    """The report is written after every section: a section that raises becomes a FAILED row,
    the next one still runs, and the run exits 1."""
    code = f"""
import sys
from pathlib import Path
import megatron_multilora as mm
from benchmarks import run
from benchmarks.settings import parse_settings

def broken(*args):
    raise RuntimeError("boom")

run.RUN_SECTION["layers"] = broken
mm.support_megatron_here()
settings, _ = parse_settings(["--quick", "--threads", "1"])
sys.exit(1 if run.run_benchmark(settings, Path({str(tmp_path)!r}), ("layers", "jobs")) else 0)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, timeout=240, capture_output=True, text=True
    )
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads((tmp_path / "cpu-only-layers-jobs.json").read_text())
    rows = {row["id"]: row for row in report["rows"]}
    assert rows["layers"]["skipped"] == "FAILED (RuntimeError: boom)"
    assert rows["4"]["ratio"] > 0
    assert report["meta"]["failed"] == {"layers": "RuntimeError: boom"}
    markdown = (tmp_path / "cpu-only-layers-jobs.md").read_text()
    assert "- sections: layers (FAILED), jobs (done)" in markdown


def test_our_step_costs_build_the_recipes_run(demo_data, tmp_path):
    """Rows 10i-10k, our side: the recipe's default run composed from conf/ on the demo data,
    its model built and its jobs started as the trainer does; every part timed."""
    code = f"""
import json, sys
from pathlib import Path
from benchmarks.peers.spec import job_spec
from benchmarks.peers.step_costs import step_cost_worker
spec = job_spec(Path({str(demo_data)!r}), 5)
step_cost_worker(spec, "ours", {str(tmp_path / "ours.json")!r}, reps=1, warmup=0)
print(json.dumps(spec))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, timeout=240, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    spec = json.loads(done.stdout.strip().splitlines()[-1])
    assert [j["name"] for j in spec["jobs"]] == ["reverse", "uppercase", "add", "sort"]
    assert spec["targets"] == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    costs = json.loads((tmp_path / "ours.json").read_text())
    assert all(costs[part] > 0 for part in ("frozen", "lora", "step")), costs


def test_step_floor_splits_each_phase_into_fixed_and_per_position_cost(demo_data):
    """benchmarks.step_floor on the default run (tiny Llama, demo data): both phases timed at
    every share of their global batch, a line fitted through them, the limit per position."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.step_floor",
            "--config-name",
            "config",
            "--reps",
            "1",
            f"data_dir={demo_data}",
        ],
        cwd=REPO,
        timeout=240,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    every, alone = out["phases"]
    assert every == "every job" and alone.endswith(" alone"), out["phases"]
    for phase in out["phases"].values():
        positions = [p for p, _ in phase["positions_ms"]]
        assert len(positions) == 4 and positions == sorted(positions, reverse=True), positions
        assert positions[0] > 4 * positions[-1]  # the shares 1/1 .. 1/8 really shrank the step
        assert all(ms > 0 for _, ms in phase["positions_ms"])
        assert math.isfinite(phase["fixed_ms"]) and math.isfinite(phase["ms_per_position"])
    assert out["matmul_parameters"] > 0 and out["limit_ms_per_position"] > 0


def test_the_peft_worker_trains_its_jobs_in_the_recipes_order(demo_data, tmp_path):
    """Rows 10 and 13, the peft side: one worker trains two of the demo jobs one after
    another and writes their step times, positions and held-out losses; a job may be named
    like a torch module attribute (the main job's ``double``)."""
    code = f"""
from pathlib import Path
from benchmarks.peers.spec import job_spec
from benchmarks.peers.peft_loop import peft_worker
spec = job_spec(Path({str(demo_data)!r}), 3)
spec["jobs"][3]["name"] = "double"
peft_worker(spec, [0, 3], 1, {str(tmp_path / "peft.json")!r})
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, timeout=240, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    got = json.loads((tmp_path / "peft.json").read_text())
    assert sorted(got["jobs"]) == ["double", "reverse"], got
    for job in got["jobs"].values():
        assert len(job["step_end_times"]) == 3 and job["positions"] > 0, job
        assert job["eval_loss"] > 0 and job["params"] > 0, job


def test_the_peft_loop_under_bf16_autocast_trains_as_in_fp32():
    """Row 13e's loop: each forward under bf16 autocast, so its steps move the adapter as fp32
    steps do (a loop-wide autocast context reuses its first bf16 copy of the LoRA weights and
    trains nothing)."""
    import torch

    from benchmarks.peers.peft_loop import PeftLoop, eval_loss, with_peft_adapters
    from megatron_multilora.data.datasets import Example
    from megatron_multilora.training.config import AdapterJob
    from tests.hf_models import make_hf_model

    gen = torch.Generator().manual_seed(0)
    examples = [
        Example(
            tuple(torch.randint(3, 128, (12,), generator=gen).tolist()), (False,) * 5 + (True,) * 6
        )
        for _ in range(4)
    ]
    job = AdapterJob(name="a", dataset="unused", rank=4, alpha=8.0, lr=1e-2, schedule="constant")
    losses = {}
    for autocast in (False, True):
        model = with_peft_adapters(make_hf_model("llama"), [job], ["q_proj", "v_proj"])
        before = eval_loss(model, examples, 0, autocast)
        loop = PeftLoop(model, job, 6, autocast)
        for _ in range(6):
            loop.step(examples, 0)
        losses[autocast] = (before, eval_loss(model, examples, 0, autocast))
    (fp32_before, fp32_after), bf16_after = losses[False], losses[True][1]
    assert fp32_after < fp32_before - 0.2, losses
    assert abs(bf16_after - fp32_after) < 0.1 * (fp32_before - fp32_after), losses


def test_versions_without_git(monkeypatch):
    """The GPU machine's image may have no git: the report then names no commit."""
    from benchmarks import report

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(report.subprocess, "run", no_git)
    found = report.versions()
    assert "git" not in found and found["torch"] and found["megatron-core"]


def test_the_soak_reads_the_service_only_with_every_tenant_held_between_calls():
    """Rows 17's memory at rest: ``hold`` returns once every tenant waits between calls (a
    tenant mid-call keeps it waiting), and ``release`` lets them go on."""
    import threading
    import time

    from benchmarks.soak import Gate

    gate, calls, stop = Gate(tenants=2), [0, 0], threading.Event()
    in_call, started = (
        [threading.Event(), threading.Event()],
        [threading.Event(), threading.Event()],
    )

    def tenant(i: int) -> None:
        while not stop.is_set():
            gate.between_calls()
            started[i].set()
            in_call[i].wait()  # the test decides when this tenant's "call" ends
            calls[i] += 1

    in_call[0].set()
    threads = [threading.Thread(target=tenant, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    assert started[1].wait(5)  # tenant 1 has begun its call before the hold
    assert not gate.hold(timeout_s=0.3)  # tenant 1 is still in its call
    held_at = list(calls)
    in_call[1].set()
    assert gate.hold(timeout_s=5)
    frozen = list(calls)
    time.sleep(0.2)
    assert calls == frozen and calls[1] <= held_at[1] + 1  # nobody runs a call while held
    gate.release()
    deadline = time.monotonic() + 5
    while calls == frozen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls != frozen
    stop.set()

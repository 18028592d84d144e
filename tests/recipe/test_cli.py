"""The recipe as users run it: torchrun from the command line with Hydra overrides.

One uninterrupted run (which also checks every output a run leaves), one killed with
SIGKILL mid-way and resumed (identical loss trajectory), one resumed from the killed run's
checkpoint under another TP layout, and a Hydra multirun.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


from megatron_multilora.training.metrics import read_metrics
from tests.recipe.conftest import job, losses_by_adapter

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS, SAVE_EVERY = 120, 20


def command(run_dir: Path, demo: Path, extra: list[str] = (), nproc: int = 2) -> list[str]:
    jobs = [job("rev", demo, "reverse", STEPS), job("add", demo, "add", STEPS, schedule="linear")]
    return [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "--local-ranks-filter=0",
            "recipes/multi_lora_finetune.py", f"run_dir={run_dir}", "hf_dir=null",
            f"adapters=[{','.join(jobs)}]",
            "lora.slots=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
            "trainer.log_interval=1", "trainer.eval_interval=0", "trainer.micro_batch_tokens=512",
            f"checkpoint.save_interval={SAVE_EVERY}", "logging.wandb_mode=disabled",
            "logging.plots=false", *extra]


def launch(cmd: list[str], log: Path) -> subprocess.Popen:
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 300) -> str:
    rc = proc.wait(timeout=timeout)
    out = log.read_text()
    assert rc == 0, f"run failed (exit {rc}):\n{out[-3000:]}"
    return out


def last_train_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    steps = [r["step"] for r in read_metrics(path) if r["kind"] == "train"] if path.exists() else []
    return max(steps, default=0)


def test_kill_and_resume_reproduces_the_uninterrupted_run(demo_data, tmp_path):
    whole = tmp_path / "whole"
    out = finish(launch(command(whole, demo_data, ["logging.plots=true",
                                                   "logging.wandb_mode=offline",
                                                   "trainer.eval_interval=60"]),
                        tmp_path / "whole.log"), tmp_path / "whole.log")
    # What a run leaves behind.
    assert "held-out loss of each adapter" in out and "job rev: done after 120 steps" in out
    for name in ("rev", "add"):
        config = json.loads((whole / "adapters" / name / "adapter_config.json").read_text())
        assert config["format"] == "megatron-multilora-adapter" and config["steps"] == STEPS
        assert (whole / "adapters" / name / "adapter.safetensors").stat().st_size > 0
    assert (whole / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (whole / "adapter_task_loss.png").is_file()
    assert list((whole / "wandb").glob("offline-run-*"))
    records = read_metrics(whole / "metrics.jsonl")
    assert {r["kind"] for r in records} == {"train", "eval"}
    assert json.loads((whole / "checkpoints" / "latest.json").read_text())["step"] == STEPS

    killed = tmp_path / "killed"
    proc = launch(command(killed, demo_data), tmp_path / "killed.log")
    deadline = time.time() + 240
    while last_train_step(killed) < 2 * SAVE_EVERY + 5:
        assert proc.poll() is None, f"run ended early:\n{(tmp_path / 'killed.log').read_text()[-2000:]}"
        assert time.time() < deadline, "the run did not progress"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    stopped_at = last_train_step(killed)
    assert stopped_at < STEPS, "the run finished before it could be killed"
    saved = json.loads((killed / "checkpoints" / "latest.json").read_text())["step"]
    assert SAVE_EVERY <= saved < stopped_at
    relayout = tmp_path / "relayout"
    shutil.copytree(killed, relayout)

    out = finish(launch(command(killed, demo_data), tmp_path / "resume.log"), tmp_path / "resume.log")
    assert f"resumed from {killed / 'checkpoints'}" in out
    want, got = losses_by_adapter(whole), losses_by_adapter(killed)
    for name in ("rev", "add"):
        assert len(got[name]) == STEPS  # logged steps after the checkpoint were dropped, rerun
        assert got[name] == want[name], f"{name}: resumed trajectory differs"

    # The same checkpoint under TP=2 + SP (dp 1) in the fully sharded mode: adapters and Adam
    # moments reshard, A and B split over the TP ranks as well.
    finish(launch(command(relayout, demo_data, ["parallel=tp2", "lora.fully_sharded=true"]),
                  tmp_path / "tp2.log"), tmp_path / "tp2.log")
    got = losses_by_adapter(relayout)
    for name in ("rev", "add"):
        assert got[name][:saved] == want[name][:saved]
        # The first step after resuming sees exactly the saved adapters; later steps drift
        # at float-rounding level, which Adam amplifies where gradients are ~0.
        first = abs(got[name][saved] - want[name][saved]) / want[name][saved]
        assert first < 1e-6, f"{name}: first step after a TP=2 resume differs by {first:.2e}"
        worst = max(abs(g - w) / w for g, w in zip(got[name][saved:], want[name][saved:]))
        assert worst < 5e-3, f"{name}: TP=2 resume drifts by {worst:.2e}"


def test_multirun_sweeps_into_separate_run_dirs(demo_data, tmp_path):
    cmd = [sys.executable, "recipes/multi_lora_finetune.py", "-m", "seed=1,2",
           *command(tmp_path / "sweep", demo_data)[5:]]
    cmd = [c.replace(f"{STEPS}", "3") if c.startswith("adapters=") else c for c in cmd]
    out = finish(launch(cmd, tmp_path / "multirun.log"), tmp_path / "multirun.log")
    for n in ("0", "1"):
        run = tmp_path / "sweep-multirun" / n
        assert (run / "adapters" / "rev" / "adapter_config.json").is_file(), out[-2000:]
    first = losses_by_adapter(tmp_path / "sweep-multirun" / "0")["rev"]
    second = losses_by_adapter(tmp_path / "sweep-multirun" / "1")["rev"]
    assert first != second  # the seeds differ

"""The benchmark's own child processes: one fresh process, or two under torchrun."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.settings import REPO, Settings
from benchmarks.timing import Clock


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def python_child(args: list[str]) -> subprocess.Popen:
    """``python -m benchmarks ARGS`` in a fresh process (its output goes to ours)."""
    return subprocess.Popen([sys.executable, "-m", "benchmarks", *args], cwd=REPO, env=child_env())


def torchrun_two(
    s: Settings, clock: Clock, worker_flag: str, what: str, worker_args: list[str] | None = None
) -> tuple[dict | None, str | None]:
    """Run the benchmark's ``worker_flag`` worker in 2 processes under torchrun (1 torch thread
    each: they share the cores); returns what rank 0 wrote, or why there is nothing."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        return None, f"skipped: {torchrun} not found"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            "--local-ranks-filter",
            "0",
            "-m",
            "benchmarks",
            worker_flag,
            "--settings-json",
            json.dumps(dataclasses.asdict(s)),
            "--result-file",
            str(out),
            *(worker_args or []),
        ]
        clock.say(f"launching 2 processes for {what}: " + " ".join(cmd[:5]) + f" ... {worker_flag}")
        env = {**child_env(), "OMP_NUM_THREADS": "1"}  # 2 processes share the cores
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        tail: list[str] = []
        for line in proc.stdout:
            print("    " + line.rstrip(), flush=True)
            tail = (tail + [line.strip()])[-20:]
        if proc.wait() != 0 or not out.exists():
            reason = next((t for t in reversed(tail) if "Error" in t), tail[-1] if tail else "")
            return None, f"skipped: the {what} run failed (exit {proc.returncode}): {reason[:200]}"
        return json.loads(out.read_text()), None

"""tinker-cookbook's supervised training loop against the service, offline: a tiny Llama
folder (its tokenizer and weights) as the base, local conversations as the data."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import time
from pathlib import Path

from megatron_multilora.models.tiny_hf import write_tiny_llama
from tests.recipe.test_api_service import REPO, Service, free_port

KEY = "tml-cookbook"


def write_conversations(path: Path, n: int = 32) -> None:
    """Short chats (two words, then the same words upper-cased), the cookbook's JSONL format."""
    rng = random.Random(0)
    words = ["cat", "dog", "sun", "tree", "moon", "fish", "star", "rain"]
    with open(path, "w") as f:
        for _ in range(n):
            text = " ".join(rng.sample(words, 2))
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": text},
                            {"role": "assistant", "content": text.upper()},
                        ]
                    }
                )
                + "\n"
            )


def test_the_cookbook_supervised_loop_trains_through_the_service(tmp_path):
    hf_dir = write_tiny_llama(tmp_path / "tiny-llama", hidden_size=64)
    write_conversations(tmp_path / "chats.jsonl")
    port = free_port()
    service = Service(
        tmp_path / "run", port, tmp_path / "service.log", keys=[KEY], overrides=[f"hf_dir={hf_dir}"]
    )
    try:
        env = {**os.environ, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1"}
        start = time.monotonic()
        done = subprocess.run(
            [
                str(REPO / ".venv/bin/python"),
                "examples/cookbook_supervised.py",
                "--port",
                str(port),
                "--hf-dir",
                str(hf_dir),
                "--conversations",
                str(tmp_path / "chats.jsonl"),
                "--log-path",
                str(tmp_path / "cookbook"),
                "--epochs",
                "3",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        # 12 tiny steps take seconds (15 s with the start-up here); a call whose answer the
        # SDK never read costs its 45 s read timeout (the client transport the service's
        # client config picks), so a loop of 45 s or more has waited one out.
        assert time.monotonic() - start < 45, "the loop waited out an SDK read timeout"
    finally:
        service.stop()
    rows = [json.loads(line) for line in open(tmp_path / "cookbook/metrics.jsonl")]
    nll = [row["train_mean_nll"] for row in rows if "train_mean_nll" in row]
    assert len(nll) == 12, nll  # 32 chats in batches of 8, three epochs
    assert sum(nll[-3:]) / 3 < sum(nll[:3]) / 3 - 0.2, nll
    # It really ran here: its steps went through the engine, and its final checkpoint is ours.
    log = service.log.read_text()
    trained = sum(int(n) for n in re.findall(r"(\d+) forward_backward in one step", log))
    assert trained == 12, log[-2000:]
    final = [json.loads(line) for line in open(tmp_path / "cookbook/checkpoints.jsonl")][-1]
    assert final["sampler_path"].startswith("tinker://"), final
    assert list((tmp_path / "run/api").glob("*/*/sampler_weights/final/adapter/*.safetensors"))


def test_the_cookbooks_rl_trainer_runs_for_tenants_at_once_with_every_loss(tmp_path):
    """examples/cookbook_rl.py, short, on a tiny Llama: tinker_cookbook.rl.train unmodified,
    one tenant per Tinker RL loss (stable_reinforce with its recorded samples), all at once;
    each ends with its reward line, and every step of every tenant trained."""
    hf_dir = write_tiny_llama(tmp_path / "tiny-llama", hidden_size=64, max_positions=2048)
    losses = ["importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"]
    tasks = ["capitalize", "upper", "reverse", "first", "capitalize", "upper"]
    done = subprocess.run(
        [
            str(REPO / ".venv/bin/python"),
            "examples/cookbook_rl.py",
            "--hf-dir",
            str(hf_dir),
            "--model-name",
            "tiny-llama",
            "--renderer",
            "role_colon",
            "--log-path",
            str(tmp_path / "rl"),
            "--tasks",
            ",".join(tasks),
            "--losses",
            ",".join(losses),
            "--steps",
            "1",
            "--groups",
            "2",
            "--group-size",
            "2",
            "--max-tokens",
            "6",
            "--test-problems",
            "2",
        ],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = re.findall(r"^tml-(\w+): mean reward (-?[\d.]+) -> (-?[\d.]+)$", done.stdout, re.M)
    names = [f"{task}{i}" if tasks.count(task) > 1 else task for i, task in enumerate(tasks)]
    assert [name for name, *_ in lines] == names, done.stdout
    log = (tmp_path / "rl/service.log").read_text()
    assert "api: refused" not in log and "failed:" not in log, log[-3000:]
    trained = sum(int(n) for n in re.findall(r"(\d+) forward_backward in one step", log))
    assert trained == len(losses), log[-3000:]  # one step each

"""tinker-cookbook's minimal RL loop (``recipes/rl_loop.py``, unmodified) against the service,
offline, with each loss it offers, as four tenants at once (each its own key, adapter and
process) on a tiny Llama: its defaults reach the service as they are (LoRA rank 32, its
prompts of a few hundred tokens, checkpoints with ttl_seconds, stable_reinforce's recorded
samples and provenance, target 0 at prompt positions)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

from megatron_multilora.models.tiny_hf import write_tiny_llama
from tests.recipe.test_api_service import REPO, Service, free_port

LOSSES = ("importance_sampling", "cispo", "gspo", "stable_reinforce")  # rl_loop's choices
MODEL = "Qwen/Qwen3-8B-Base"  # a name the cookbook knows (its renderer: role_colon)


def test_the_cookbooks_rl_loop_runs_unmodified_with_each_loss(tmp_path):
    hf_dir = write_tiny_llama(tmp_path / "tiny-llama", hidden_size=64, max_positions=2048)
    keys = [f"tml-rl-{loss}" for loss in LOSSES]
    port = free_port()
    service = Service(
        tmp_path / "run",
        port,
        tmp_path / "service.log",
        keys=keys,
        # conf/api.yaml's sequence lengths (the shared test helper shortens them)
        overrides=[
            f"hf_dir={hf_dir}",
            f"api.model_name={MODEL}",
            "trainer.max_seq_len=2048",
            "trainer.micro_batch_tokens=2048",
        ],
    )
    tenants = {  # forked from one process, all at once (see run_rl_loop.py)
        key: [
            f"base_url=http://127.0.0.1:{port}",
            f"log_path={tmp_path / loss}",
            f"loss_fn={loss}",
            "batch_size=2",
            "group_size=4",
            "max_tokens=8",
            "max_steps=2",
            "save_every=1",
        ]
        for key, loss in zip(keys, LOSSES)
    }
    run = subprocess.Popen(
        [
            str(REPO / ".venv/bin/python"),
            "tests/recipe/run_rl_loop.py",
            str(hf_dir),
            MODEL,
            json.dumps(tenants),
        ],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its tenants too: killed together below
    )
    try:
        out, _ = run.communicate(timeout=400)
        assert run.returncode == 0, out[-8000:]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        service.stop()
    log = service.log.read_text()
    assert "api: refused" not in log and "failed:" not in log, log[-3000:]
    trained = [int(n) for n in re.findall(r"(\d+) forward_backward in one step", log)]
    assert sum(trained) == 2 * len(LOSSES), log[-3000:]  # every step of every tenant trained
    for loss in LOSSES:
        rows = [json.loads(line) for line in open(tmp_path / loss / "metrics.jsonl")]
        assert [r["progress/batch"] for r in rows] == [0, 1], rows
    index = json.loads((tmp_path / "run/api/checkpoints.json").read_text())
    saved = [e for path, e in index.items() if path.endswith("/weights/000001")]
    assert len(saved) == len(LOSSES) and all("expires_at" in e for e in saved)  # ttl_seconds
    assert all(e["rank"] == 32 for e in index.values())  # its default rank

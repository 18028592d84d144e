"""tinker-cookbook's minimal RL loop (``tinker_cookbook/recipes/rl_loop.py``, its ``main``
unmodified) against a local service, offline: its tokenizer comes from the service's
Hugging Face folder, GSM8K (``datasets.load_dataset("openai/gsm8k")``, a download) is
replaced by a few local rows of its format, and the reward by one that varies between a tiny
random model's samples (a checksum of the answer), so advantages vary and every step trains.

    python tests/recipe/run_rl_loop.py HF_DIR MODEL_NAME TENANTS_JSON

TENANTS_JSON maps each tenant's API key to its rl_loop chz arguments (``log_path=...`` among
them). The imports are made once (seconds of CPU each time); then every tenant runs at once,
in a process of its own forked from this one, with its key as TINKER_API_KEY and its output
in ``<log_path>.out``. Exits 1 if any tenant failed, after printing each failed one's output.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import chz
import datasets
from tinker_cookbook.recipes import rl_loop
from tinker_cookbook.tokenizer_utils import register_tokenizer
from transformers import AutoTokenizer


def gsm8k_rows(*args, **kwargs) -> datasets.DatasetDict:
    rows = [{"question": f"What is {k} + {k}?", "answer": f"... #### {2 * k}"} for k in range(64)]
    return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})


def checksum(response: str, answer: str) -> float:
    return sum(map(ord, response)) % 7 / 6


def start_tenant(model_name: str, key: str, arguments: list[str], out: Path) -> int:
    """Fork a process that runs rl_loop.main for one tenant; returns its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ["TINKER_API_KEY"] = key
    code = 1
    try:
        chz.nested_entrypoint(rl_loop.main, argv=[f"model_name={model_name}", *arguments])
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    hf_dir, model_name, tenants = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    register_tokenizer(model_name, lambda: AutoTokenizer.from_pretrained(hf_dir))
    rl_loop.datasets.load_dataset = gsm8k_rows
    rl_loop.get_reward = checksum
    outs = {}
    for key, arguments in tenants.items():
        log_path = next(a.split("=", 1)[1] for a in arguments if a.startswith("log_path="))
        outs[start_tenant(model_name, key, arguments, Path(f"{log_path}.out"))] = (key, log_path)
    failed = 0
    for pid, (key, log_path) in outs.items():
        if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
            failed += 1
            print(f"{key} failed:\n{Path(f'{log_path}.out').read_text()[-4000:]}")
    sys.exit(1 if failed else 0)

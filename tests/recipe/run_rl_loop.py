"""tinker-cookbook's minimal RL loop (``tinker_cookbook/recipes/rl_loop.py``, its ``main``
unmodified) against a local service, offline: its tokenizer comes from the service's
Hugging Face folder, GSM8K (``datasets.load_dataset("openai/gsm8k")``, a download) is
replaced by a few local rows of its format, and the reward by one that varies between a tiny
random model's samples (a checksum of the answer), so advantages vary and every step trains.

    python tests/recipe/run_rl_loop.py HF_DIR MODEL_NAME [rl_loop's chz arguments ...]
"""

from __future__ import annotations

import sys

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


if __name__ == "__main__":
    hf_dir, model_name, *arguments = sys.argv[1:]
    register_tokenizer(model_name, lambda: AutoTokenizer.from_pretrained(hf_dir))
    rl_loop.datasets.load_dataset = gsm8k_rows
    rl_loop.get_reward = checksum
    chz.nested_entrypoint(rl_loop.main, argv=[f"model_name={model_name}", *arguments])

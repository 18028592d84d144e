"""Small demo tasks with exact-match answers, one distinct behaviour per adapter.

Every task uses the same prompt format, ``"<input>="``, and three of them share the same
input distribution (lowercase words), so which task to perform is known only to the adapter
that learned it.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Callable

from megatron_multilora.atomic_files import atomic_file


def _word(rng: random.Random) -> str:
    """A random lowercase word of 3-8 letters."""
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))


def _reverse(rng: random.Random) -> dict:
    word = _word(rng)
    return {"prompt": f"{word}=", "completion": word[::-1]}


def _uppercase(rng: random.Random) -> dict:
    word = _word(rng)
    return {"prompt": f"{word}=", "completion": word.upper()}


def _add(rng: random.Random) -> dict:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return {"prompt": f"{a}+{b}=", "completion": str(a + b)}


def _sort(rng: random.Random) -> dict:
    word = _word(rng)
    return {"prompt": f"{word}=", "completion": "".join(sorted(word))}


TASKS: dict[str, Callable[[random.Random], dict]] = {
    "reverse": _reverse,
    "uppercase": _uppercase,
    "add": _add,
    "sort": _sort,
}


def _rng(task: str, seed: int, stream: str) -> random.Random:
    # A string seed is hashed deterministically (not via hash()), so streams are stable
    # across processes, and each task/stream gets its own sequence for the same seed.
    return random.Random(f"{task}/{stream}/{seed}")


def _draw(task: str, rng: random.Random, n: int, exclude: set[str]) -> list[dict]:
    """``n`` records of ``task`` whose prompts are not in ``exclude``."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {sorted(TASKS)}")
    make, records, attempts = TASKS[task], [], 0
    while len(records) < n:
        attempts += 1
        # Bounded so an exclusion set covering (nearly) the whole input space fails loudly.
        if attempts > 100 * n + 1000:
            raise ValueError(f"could not draw {n} {task!r} examples outside the excluded "
                             f"{len(exclude)} prompts")
        record = make(rng)
        if record["prompt"] not in exclude:
            records.append(record)
    return records


def make_examples(task: str, n: int, seed: int) -> list[dict]:
    """``n`` ``{"prompt", "completion"}`` records of ``task``, a pure function of the seed."""
    return _draw(task, _rng(task, seed, "train"), n, exclude=set())


def _write_jsonl(path: Path, records: list[dict]) -> None:
    """Write records one JSON object per line; readers never see a half-written file."""
    with atomic_file(path) as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def write_demo_datasets(out_dir: str | Path, n_train: int = 512, n_eval: int = 64,
                        seed: int = 0) -> dict[str, dict[str, Path]]:
    """Write ``{task}.train.jsonl`` and ``{task}.eval.jsonl`` for every task in ``out_dir``.

    Train records are ``make_examples(task, n_train, seed)``; eval records come from a
    separate random stream and skip any prompt seen in train, so eval measures
    generalisation. Returns ``{task: {"train": path, "eval": path}}``.
    """
    if n_train < 1 or n_eval < 1:
        raise ValueError(f"n_train and n_eval must be >= 1, got {n_train} and {n_eval}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, dict[str, Path]] = {}
    for task in TASKS:
        train = make_examples(task, n_train, seed)
        held_out = _draw(task, _rng(task, seed, "eval"), n_eval,
                         exclude={r["prompt"] for r in train})
        paths[task] = {"train": out / f"{task}.train.jsonl", "eval": out / f"{task}.eval.jsonl"}
        _write_jsonl(paths[task]["train"], train)
        _write_jsonl(paths[task]["eval"], held_out)
    return paths


def exact_match(prediction: str, completion: str) -> bool:
    """Whether a generated answer equals the reference, ignoring surrounding whitespace."""
    return prediction.strip() == completion.strip()

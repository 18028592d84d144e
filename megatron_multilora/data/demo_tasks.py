"""Small demo tasks with exact-match answers, one distinct behaviour per adapter.

Two task sets, each with one prompt format, ``"<input>="``, and (mostly) one input
distribution, so which task to perform is known only to the adapter that learned it:

- ``letters`` (``TASKS``): reverse / uppercase / sort the letters of a random string, add two
  numbers. Character-level, for the tiny byte-level model.
- ``words`` (``WORD_TASKS``): reverse / sort / capitalise / double three common English
  words. Word-level, for a real BPE model (SmolLM2): every word is one token, so a pretrained
  model learns each task from a few hundred examples.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from pathlib import Path

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

# Common nouns that are single tokens with a leading space, lower and capitalised, in
# SmolLM2's tokenizer (checked against data/smollm2-135m-instruct's tokenizer.json).
WORDS = tuple(
    """
apple river stone cloud horse table window garden paper music tiger honey bread chair ocean
mirror forest rabbit silver castle dragon planet summer winter butter camera doctor engine
finger guitar hammer island orange pepper rocket yellow basket cotton desert farmer ginger
lemon monkey number sugar bridge flower shadow spider temple tunnel valley copper eagle harbor
lamp moon nest owl pearl queen ring ship train tree wolf bell book coin drum fish frog king
lake milk rain rose salt snow star sun wind
""".split()
)


def _word_task(answer: Callable[[list[str]], list[str]]) -> Callable[[random.Random], dict]:
    """A task on three distinct words: prompt ``"w1 w2 w3 ="``, completion the answer's
    words after a space (so each is the same single token as in the prompt)."""

    def make(rng: random.Random) -> dict:
        words = rng.sample(WORDS, 3)
        return {"prompt": " ".join(words) + " =", "completion": " " + " ".join(answer(words))}

    return make


WORD_TASKS: dict[str, Callable[[random.Random], dict]] = {
    "reverse_words": _word_task(lambda w: w[::-1]),
    "sort_words": _word_task(sorted),
    "capitalize": _word_task(lambda w: [x.capitalize() for x in w]),
    "double": _word_task(lambda w: [x for x in w for _ in range(2)]),
}

TASK_SETS = {"letters": TASKS, "words": WORD_TASKS}
_ALL_TASKS = {**TASKS, **WORD_TASKS}


def _rng(task: str, seed: int, stream: str) -> random.Random:
    # A string seed is hashed deterministically (not via hash()), so streams are stable
    # across processes, and each task/stream gets its own sequence for the same seed.
    return random.Random(f"{task}/{stream}/{seed}")


def _draw(task: str, rng: random.Random, n: int, exclude: set[str]) -> list[dict]:
    """``n`` records of ``task`` whose prompts are not in ``exclude``."""
    if task not in _ALL_TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {sorted(_ALL_TASKS)}")
    make, records, attempts = _ALL_TASKS[task], [], 0
    while len(records) < n:
        attempts += 1
        # Bounded so an exclusion set covering (nearly) the whole input space fails loudly.
        if attempts > 100 * n + 1000:
            raise ValueError(
                f"could not draw {n} {task!r} examples outside the excluded {len(exclude)} prompts"
            )
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


def write_demo_datasets(
    out_dir: str | Path,
    n_train: int = 512,
    n_eval: int = 64,
    seed: int = 0,
    task_set: str = "letters",
) -> dict[str, dict[str, Path]]:
    """Write ``{task}.train.jsonl`` and ``{task}.eval.jsonl`` for every task of ``task_set``
    (a key of ``TASK_SETS``) in ``out_dir``.

    Train records are ``make_examples(task, n_train, seed)``; eval records come from a
    separate random stream and skip any prompt seen in train, so eval measures
    generalisation. Returns ``{task: {"train": path, "eval": path}}``.
    """
    if n_train < 1 or n_eval < 1:
        raise ValueError(f"n_train and n_eval must be >= 1, got {n_train} and {n_eval}")
    if task_set not in TASK_SETS:
        raise ValueError(f"unknown task set {task_set!r}; expected one of {sorted(TASK_SETS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, dict[str, Path]] = {}
    for task in TASK_SETS[task_set]:
        train = make_examples(task, n_train, seed)
        held_out = _draw(
            task, _rng(task, seed, "eval"), n_eval, exclude={r["prompt"] for r in train}
        )
        paths[task] = {"train": out / f"{task}.train.jsonl", "eval": out / f"{task}.eval.jsonl"}
        _write_jsonl(paths[task]["train"], train)
        _write_jsonl(paths[task]["eval"], held_out)
    return paths


def _pair(record: dict) -> dict:
    """A preference pair: the task's answer over echoing the input (what an untrained model
    tends to do)."""
    echo = record["prompt"].rstrip("=").strip()
    echo = " " + echo if record["completion"].startswith(" ") else echo
    return {"prompt": record["prompt"], "chosen": record["completion"], "rejected": echo}


def write_post_training_datasets(
    out_dir: str | Path,
    n_train: int = 512,
    n_eval: int = 64,
    seed: int = 0,
    task_set: str = "letters",
) -> dict[str, dict[str, Path]]:
    """Next to :func:`write_demo_datasets`' files (written too), for every task: preference
    pairs ``{task}.pairs.{train,eval}.jsonl`` (the answer chosen, the echoed input
    rejected) and prompts ``{task}.prompts.{train,eval}.jsonl`` (``{"prompt", "answer"}``,
    for a reward); the same records as the task's completion files. Returns ``{task:
    {"pairs_train", "pairs_eval", "prompts_train", "prompts_eval": path}}``."""
    written = write_demo_datasets(out_dir, n_train, n_eval, seed, task_set)
    out: dict[str, dict[str, Path]] = {}
    for task, paths in written.items():
        out[task] = {}
        for split in ("train", "eval"):
            records = [json.loads(line) for line in paths[split].read_text().splitlines()]
            out[task][f"pairs_{split}"] = paths[split].with_name(f"{task}.pairs.{split}.jsonl")
            out[task][f"prompts_{split}"] = paths[split].with_name(f"{task}.prompts.{split}.jsonl")
            _write_jsonl(out[task][f"pairs_{split}"], [_pair(r) for r in records])
            _write_jsonl(
                out[task][f"prompts_{split}"],
                [{"prompt": r["prompt"], "answer": r["completion"]} for r in records],
            )
    return out


def exact_match(prediction: str, completion: str) -> bool:
    """Whether a generated answer equals the reference, ignoring surrounding whitespace."""
    return prediction.strip() == completion.strip()


def may_still_match(partial: str, completion: str) -> bool:
    """Whether a generation that has produced the text ``partial`` so far can still end as
    an :func:`exact_match` of ``completion``, text only ever being appended to it. A
    replacement character (a token ending inside a multi-byte character) is not judged."""
    if "\ufffd" in partial:
        return True
    done, target = partial.lstrip(), completion.strip()
    return target.startswith(done) or done.rstrip() == target

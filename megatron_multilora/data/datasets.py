"""JSONL fine-tuning datasets: validation with file:line errors, tokenization, truncation.

Each non-blank line of a dataset file is one record, in one of two forms::

    {"prompt": "12+7=", "completion": "19"}
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}

Only what the model should produce is trained: the completion and eos, or the assistant
messages and eos (see ``ByteTokenizer.encode_chat``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from megatron_multilora.data.tokenizer import CHAT_ROLES, Tokenizer

_EXPECTED = ('expected {"prompt": str, "completion": str} or '
             '{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}')


@dataclass(frozen=True)
class Example:
    """One tokenized record.

    ``loss_mask[i]`` says whether predicting ``tokens[i + 1]`` from position ``i`` counts in
    the loss, so ``len(loss_mask) == len(tokens) - 1``.
    """

    tokens: tuple[int, ...]
    loss_mask: tuple[bool, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) < 2:
            raise ValueError(f"an Example needs at least 2 tokens, got {len(self.tokens)}")
        if len(self.loss_mask) != len(self.tokens) - 1:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for "
                             f"{len(self.tokens)} tokens; expected {len(self.tokens) - 1}")


class DatasetError(ValueError):
    """A dataset file problem; the message starts with ``"path:line: "`` or ``"path: "``."""


def _record_problem(record: object) -> str | None:
    """What is wrong with one parsed record, or None if it is a valid record."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}; {_EXPECTED}"
    keys = set(record)
    if keys == {"prompt", "completion"}:
        for key in ("prompt", "completion"):
            if not isinstance(record[key], str):
                return f'"{key}" must be a string, got {type(record[key]).__name__}'
        if not record["completion"]:
            return '"completion" is empty; there would be nothing to train on'
        return None
    if keys == {"messages"}:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            return '"messages" must be a non-empty list of {"role": ..., "content": ...} objects'
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or set(message) != {"role", "content"}:
                return (f'messages[{i}] must be an object with exactly "role" and "content", '
                        f"got {message!r:.80}")
            if message["role"] not in CHAT_ROLES:
                return f"messages[{i}]: unknown role {message['role']!r}; expected one of {CHAT_ROLES}"
            if not isinstance(message["content"], str):
                return (f'messages[{i}]: "content" must be a string, '
                        f"got {type(message['content']).__name__}")
        if not any(m["role"] == "assistant" for m in messages):
            return 'no "assistant" message; there would be nothing to train on'
        return None
    return f"unexpected keys {sorted(keys)}; {_EXPECTED}"


def _numbered_records(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Yield ``(1-based line number, record)`` for each non-blank line, validated."""
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise DatasetError(f"{path}: file not found") from None
    except OSError as e:
        raise DatasetError(f"{path}: cannot open ({e.strerror})") from None
    seen = False
    with handle:
        # Read bytes and decode line by line, so bad UTF-8 is reported with its line too.
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{path}:{number}: not valid UTF-8 ({e.reason})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{number}: malformed JSON ({e.msg} at column "
                                   f"{e.colno}); expected one JSON object per line") from None
            problem = _record_problem(record)
            if problem is not None:
                raise DatasetError(f"{path}:{number}: {problem}")
            seen = True
            yield number, record
    if not seen:
        raise DatasetError(f"{path}: no records (the file is empty or blank); {_EXPECTED}, "
                           "one per line")


def read_jsonl_records(path: str | Path) -> list[dict]:
    """Parse and validate a JSONL dataset file into its records, in file order.

    Needs no tokenizer, so a run's data can be checked before any model is built.
    Raises DatasetError naming ``path:line`` for the first bad line.
    """
    return [record for _, record in _numbered_records(path)]


def _truncate(ids: list[int], trained: list[bool], max_seq_len: int) -> tuple[list[int], list[bool]]:
    """Cut a bos-led sequence to ``max_seq_len`` tokens, keeping its trained part if possible.

    The prompt is everything between bos and the first trained token. It loses tokens from
    its left (bos stays, as the model always sees it first); if the trained part alone does
    not fit after bos, the prompt goes entirely and the rest is cut on the right.
    """
    excess = len(ids) - max_seq_len
    if excess <= 0:
        return ids, trained
    prompt_len = trained.index(True, 1) - 1  # tokens between bos and the first trained one
    cut = min(excess, prompt_len)
    ids, trained = ids[:1] + ids[1 + cut:], trained[:1] + trained[1 + cut:]
    return ids[:max_seq_len], trained[:max_seq_len]


def tokenize_record(record: dict, tokenizer: Tokenizer, max_seq_len: int) -> Example:
    """Tokenize one record into an Example of at most ``max_seq_len`` tokens.

    prompt/completion: ``[bos] + prompt + completion + [eos]``, loss on predicting the
    completion and eos. chat: ``tokenizer.encode_chat``, loss on the assistant tokens and
    eos. Too-long sequences lose the start of the prompt first; the loss mask always keeps
    at least one True. Raises ValueError for an invalid record or ``max_seq_len < 2``.
    """
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2 (one input and one label), got {max_seq_len}")
    problem = _record_problem(record)
    if problem is not None:
        raise ValueError(problem)
    if "messages" in record:
        ids, trained = tokenizer.encode_chat(record["messages"])
    else:
        prompt = [tokenizer.bos_id] + tokenizer.encode(record["prompt"])
        completion = tokenizer.encode(record["completion"]) + [tokenizer.eos_id]
        ids, trained = prompt + completion, [False] * len(prompt) + [True] * len(completion)
    # trained[0] is bos's flag, which never becomes a label.
    if not any(trained[1:]):
        raise ValueError("the record has no tokens to train on")
    ids, trained = _truncate(ids, trained, max_seq_len)
    return Example(tokens=tuple(ids), loss_mask=tuple(trained[1:]))


def load_dataset(path: str | Path, tokenizer: Tokenizer, max_seq_len: int) -> list[Example]:
    """Read, validate and tokenize a JSONL dataset; errors name ``path:line``."""
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2 (one input and one label), got {max_seq_len}")
    examples = []
    for number, record in _numbered_records(path):
        try:
            examples.append(tokenize_record(record, tokenizer, max_seq_len))
        except ValueError as e:
            raise DatasetError(f"{path}:{number}: {e}") from e
    return examples

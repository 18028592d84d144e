"""The record forms a job's data comes in, one per kind of objective: what a valid record
is, and its tokens.

* ``completion`` (SFT): ``{"prompt": str, "completion": str}`` or ``{"messages": [...]}``;
  the completion (the assistant messages) and eos are trained.
* ``preference`` (DPO): ``{"prompt", "chosen", "rejected"}``, each a string, or the prompt a
  message list and the answers lists of assistant messages; two sequences per record.
* ``prompt`` (GRPO): ``{"prompt": str | messages, ...}``; any other fields ride along for the
  reward (e.g. ``"answer"``); completions are sampled.

Validators return a problem in words or None; tokenisers return ``(ids, trained)`` with
``trained[i]`` True where token ``i`` is what the model should produce.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_multilora.data.tokenizer import CHAT_ROLES, Tokenizer

FORMS = ("completion", "preference", "prompt")

EXPECTED = {
    "completion": (
        'expected {"prompt": str, "completion": str} or '
        '{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}'
    ),
    "preference": (
        'expected {"prompt": str, "chosen": str, "rejected": str} (or the prompt a '
        "message list and chosen/rejected lists of assistant messages)"
    ),
    "prompt": 'expected {"prompt": str or a message list, ...any fields the reward reads}',
}


def _messages_problem(messages: object, key: str, need_assistant: bool) -> str | None:
    if not isinstance(messages, list) or not messages:
        return f'"{key}" must be a non-empty list of {{"role": ..., "content": ...}} objects'
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            return (
                f'{key}[{i}] must be an object with exactly "role" and "content", '
                f"got {message!r:.80}"
            )
        if message["role"] not in CHAT_ROLES:
            return f"{key}[{i}]: unknown role {message['role']!r}; expected one of {CHAT_ROLES}"
        if not isinstance(message["content"], str):
            return (
                f'{key}[{i}]: "content" must be a string, got {type(message["content"]).__name__}'
            )
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        return f'{key}: no "assistant" message; there would be nothing to train on'
    return None


def _text_or_messages_problem(record: dict, key: str, need_assistant: bool) -> str | None:
    value = record[key]
    if isinstance(value, str):
        return None if value or not need_assistant else f'"{key}" is empty; nothing to train on'
    if isinstance(value, list):
        return _messages_problem(value, key, need_assistant)
    return f'"{key}" must be a string or a message list, got {type(value).__name__}'


def completion_problem(record: dict) -> str | None:
    keys = set(record)
    if keys == {"prompt", "completion"}:
        for key in ("prompt", "completion"):
            if not isinstance(record[key], str):
                return f'"{key}" must be a string, got {type(record[key]).__name__}'
        if not record["completion"]:
            return '"completion" is empty; there would be nothing to train on'
        return None
    if keys == {"messages"}:
        return _messages_problem(record["messages"], "messages", need_assistant=True)
    return f"unexpected keys {sorted(keys)}; {EXPECTED['completion']}"


def preference_problem(record: dict) -> str | None:
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in record]
    if missing:
        return f"missing {', '.join(repr(k) for k in missing)}; {EXPECTED['preference']}"
    extra = sorted(set(record) - {"prompt", "chosen", "rejected"})
    if extra:
        return f"unexpected keys {extra}; {EXPECTED['preference']}"
    problem = _text_or_messages_problem(record, "prompt", need_assistant=False)
    for key in ("chosen", "rejected"):
        problem = problem or _text_or_messages_problem(record, key, need_assistant=True)
    if problem is None and isinstance(record["chosen"], str) != isinstance(record["rejected"], str):
        problem = '"chosen" and "rejected" must both be strings or both message lists'
    if (
        problem is None
        and not isinstance(record["chosen"], str)
        and isinstance(record["prompt"], str)
    ):
        problem = 'message-list answers need a message-list "prompt"'
    return problem


def prompt_problem(record: dict) -> str | None:
    if "prompt" not in record:
        return f"missing 'prompt'; {EXPECTED['prompt']}"
    return _text_or_messages_problem(record, "prompt", need_assistant=False)


PROBLEMS: dict[str, Callable[[dict], str | None]] = {
    "completion": completion_problem,
    "preference": preference_problem,
    "prompt": prompt_problem,
}


def prompt_ids(prompt: str | list, tokenizer: Tokenizer) -> list[int]:
    """The tokens a completion follows: ``bos + prompt``, or a chat prompt rendered (without
    the eos a chat encoding ends with)."""
    if isinstance(prompt, str):
        return [tokenizer.bos_id] + tokenizer.encode(prompt)
    return tokenizer.encode_chat(prompt)[0][:-1]


def answer_ids(
    prompt: str | list, answer: str | list, tokenizer: Tokenizer
) -> tuple[list[int], list[bool]]:
    """``prompt`` followed by ``answer`` and eos; trained: the answer's tokens and eos."""
    if isinstance(answer, str):
        head = prompt_ids(prompt, tokenizer)
        tail = tokenizer.encode(answer) + [tokenizer.eos_id]
        return head + tail, [False] * len(head) + [True] * len(tail)
    ids, trained = tokenizer.encode_chat([*prompt, *answer])
    head = len(prompt_ids(prompt, tokenizer))
    return ids, [False] * head + trained[head:]  # the prompt's own assistant turns are context

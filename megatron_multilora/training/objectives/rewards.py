"""GRPO rewards: the built-in ones by name, or a user's function by import path.

A reward is called as ``reward(prompt=..., completion=..., record=...)`` (the record as the
dataset holds it, columns renamed) and returns a real number. Built in:

* ``exact_match``: 1.0 when the completion equals the record's ``answer`` (surrounding
  whitespace ignored), else 0.0;
* ``word_match``: the fraction of the answer's words the completion contains (partial
  credit).
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable
from typing import Any

Reward = Callable[..., float]


def exact_match(prompt: Any, completion: str, record: dict) -> float:
    return float(completion.strip() == str(record["answer"]).strip())


def word_match(prompt: Any, completion: str, record: dict) -> float:
    wanted = str(record["answer"]).split()
    if not wanted:
        return float(not completion.strip())
    have = set(completion.split())
    return sum(word in have for word in wanted) / len(wanted)


BUILT_IN: dict[str, Reward] = {"exact_match": exact_match, "word_match": word_match}


class RewardError(ValueError):
    """A reward that cannot be loaded, raised, or returned something not a real number."""


def load_reward(spec: str) -> Reward:
    """A built-in reward's name, or ``module:function`` (the module importable from the
    working directory or ``PYTHONPATH``)."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    module_name, _, function = spec.partition(":")
    if not module_name or not function:
        raise RewardError(f"reward={spec!r}: use {' or '.join(BUILT_IN)}, or module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a user's module may fail to import in any way
        raise RewardError(
            f"reward={spec!r}: cannot import {module_name} ({type(e).__name__}: {e})"
        ) from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise RewardError(f"reward={spec!r}: {module_name} has no function {function!r}")
    return fn


def score(reward: Reward, spec: str, prompt: Any, completion: str, record: dict) -> float:
    """``reward``'s value, or RewardError saying what went wrong (the caller names the job
    and record)."""
    try:
        value = reward(prompt=prompt, completion=completion, record=record)
    except Exception as e:  # the user's function: report whatever it raised
        raise RewardError(f"reward {spec} raised {type(e).__name__}: {e}") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RewardError(
            f"reward {spec} returned {value!r:.80}; it must return a finite real number"
        )
    return float(value)

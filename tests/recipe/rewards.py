"""Rewards the objective tests import by path (``tests.recipe.rewards:<name>``)."""


def letters(prompt, completion, record):
    """The share of lowercase letters in the completion: varies between samples of an
    untrained model, so advantages are not all zero."""
    return sum(c.islower() for c in completion) / max(len(completion), 1)


def slow_letters(prompt, completion, record):
    """:func:`letters`, slowly (a rollout takes a while: a test can stop the run mid-way)."""
    import time

    time.sleep(0.05)
    return letters(prompt, completion, record)


def raises(prompt, completion, record):
    raise RuntimeError("the grader is down")


def not_a_number(prompt, completion, record):
    return "high"

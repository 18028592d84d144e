"""Sampling that does not depend on the batch: each row's draws are keyed by (its key, the
token's index), so a row gets the same samples whichever rows share its generation pass, on
every layout and after a resume.

A row's next token is drawn from its softmax at its ``temperature``, restricted to the
smallest set of most likely tokens whose probability reaches its ``top_p`` (nucleus), by
inverting its CDF (in vocabulary order; with a nucleus, most likely first) at one uniform
number drawn from a generator seeded with the row's key and the token's index. Temperature 0
is greedy decoding (vLLM's and SGLang's meaning): the most likely token, the first on a tie.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """How one row samples: its key (e.g. ``seed:job:rollout:row``), temperature (0: greedy),
    top-p."""

    key: str
    temperature: float = 1.0
    top_p: float = 1.0


def uniform(key: str, index: int) -> float:
    """The uniform number in [0, 1) of draw ``index`` for ``key``."""
    seed = zlib.crc32(f"{key}:{index}".encode())
    return float(torch.rand((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64))


class KeyedSampler:
    """A generation ``Pick`` for prompts ``rows[i]`` (by prompt index)."""

    def __init__(self, rows: Sequence[RowSampling]) -> None:
        self.rows = list(rows)

    def __call__(self, logits: torch.Tensor, rows: list[int], generated: list[int]) -> torch.Tensor:
        spec = [self.rows[i] for i in rows]
        temperature = torch.tensor([s.temperature for s in spec], dtype=torch.float64)
        top_p = torch.tensor([s.top_p for s in spec], dtype=torch.float64)
        u = torch.tensor([uniform(s.key, t) for s, t in zip(spec, generated)], dtype=torch.float64)
        greedy = temperature == 0
        scaled = logits.cpu().double() / torch.where(greedy, 1.0, temperature)[:, None]
        probs = torch.softmax(scaled, dim=-1)
        tokens = torch.empty(len(spec), dtype=torch.int64)
        tokens[greedy] = scaled[greedy].argmax(-1)
        full = (top_p >= 1.0) & ~greedy  # rows without a nucleus: CDF in vocabulary order
        if full.any():
            tokens[full] = _invert(probs[full], u[full])
        nucleus = ~full & ~greedy
        if nucleus.any():
            ordered, index = probs[nucleus].sort(dim=-1, descending=True, stable=True)
            # Keep a token while the more likely ones do not yet reach top_p (the first always).
            kept = torch.where(
                ordered.cumsum(-1) - ordered < top_p[nucleus, None],
                ordered,
                torch.zeros((), dtype=torch.float64),
            )
            tokens[nucleus] = index.gather(1, _invert(kept, u[nucleus])[:, None]).flatten()
        return tokens


def _invert(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's index where its CDF (``weights`` ``[B, V]``, not normalised) reaches ``u``."""
    cdf = weights.cumsum(-1)
    at = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    return at.clamp(max=weights.size(-1) - 1).flatten()


def cut_at_stop_strings(
    decode: Callable[[list[int]], str],
    tokens: list[int],
    logprobs: list[float],
    ended: bool,
    strings: Sequence[str],
) -> tuple[list[int], list[float], bool]:
    """A sample up to the first token whose text (``decode``) completes a stop string
    (included), as if it had stopped there: its draws before that point do not depend on
    later ones."""

    def stops(k: int) -> bool:
        text = decode(tokens[:k])
        return any(s in text for s in strings)

    if not strings or not stops(len(tokens)):
        return tokens, logprobs, ended
    low, high = 1, len(tokens)  # the shortest stopping prefix: a longer one stops too
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if stops(mid) else (mid + 1, high)
    return tokens[:high], logprobs[:high], True

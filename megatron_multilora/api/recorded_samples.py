"""The samples a sampling client made with ``record_stability_info=True`` draws, kept by the
engine (the same on every rank) so that a ``stable_reinforce`` datum's provenance can name
them: each sample by its ``sequence_id``, with its session, prompt, tokens and log-probs.

As Tinker's, a sample belongs to the session that drew it and can be trained on for a day
after it was drawn, each use restarting the day; a session's samples go with it, and a
session keeps at most ``PER_SESSION`` (its oldest go first). No torch.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from megatron_multilora.api.ops import OpError
from megatron_multilora.api.wire import Span

KEEP_S = 24 * 3600.0
PER_SESSION = 65536


@dataclasses.dataclass
class Recorded:
    session: str
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    used: float  # time.monotonic() of its drawing or its last use


class RecordedSamples:
    def __init__(self) -> None:
        self.samples: dict[str, Recorded] = {}  # by sequence_id, oldest first
        self.counts: dict[str, int] = {}  # by session

    def record(
        self,
        session: str,
        sequence_id: str,
        prompt: list[int],
        tokens: list[int],
        logprobs: list[float],
    ) -> None:
        self._expire()
        if self.counts.get(session, 0) >= PER_SESSION:
            oldest = next(k for k, r in self.samples.items() if r.session == session)
            self._drop(oldest)
        self.samples[sequence_id] = Recorded(session, prompt, tokens, logprobs, time.monotonic())
        self.counts[session] = self.counts.get(session, 0) + 1

    def forget(self, session: str) -> None:
        """The session has ended: its samples go."""
        for key in [k for k, r in self.samples.items() if r.session == session]:
            self._drop(key)

    def sampler_logprobs(
        self,
        session: str,
        tokens: Sequence[int],
        targets: Sequence[int],
        spans: tuple[list[Span], list[Span]],
        logprobs: Sequence[float],
        where: str,
    ) -> tuple[float, ...]:
        """A datum's sampler log-probs: the recorded ones at its sampled targets (the
        client's elsewhere), once its provenance checks out against the record: each
        named sample is this session's, and the tokens the runs claim are the sample's."""
        now, out = time.monotonic(), list(logprobs)
        for field, runs, own in (("model_input", spans[0], tokens), ("targets", spans[1], targets)):
            position = 0
            for kind, sequence_id, offset, length in runs:
                sample = self.samples.get(sequence_id)
                if sample is None or sample.session != session or now - sample.used > KEEP_S:
                    raise OpError(
                        f"{where}: sequence_id {sequence_id!r} names no recorded sample of this "
                        "session (sample with record_stability_info=True, in this session, "
                        "within a day)"
                    )
                sample.used = now
                source = sample.prompt if kind == "prompt" else sample.tokens
                claimed = source[offset : offset + length]
                # Targets at prompt positions carry no sampler log-prob: a client may pad them.
                checked = field == "model_input" or kind == "sampled"
                if checked and list(own[position : position + length]) != claimed:
                    raise OpError(
                        f"{where}: {field} positions {position} to {position + length - 1} "
                        f"are not the {kind} tokens {offset} to {offset + length - 1} of "
                        f"sample {sequence_id!r}"
                    )
                if field == "targets" and kind == "sampled":
                    out[position : position + length] = sample.logprobs[offset : offset + length]
                position += length
        return tuple(out)

    def _drop(self, sequence_id: str) -> None:
        sample = self.samples.pop(sequence_id)
        self.counts[sample.session] -= 1
        if not self.counts[sample.session]:
            del self.counts[sample.session]

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, r in self.samples.items() if now - r.used > KEEP_S]:
            self._drop(key)

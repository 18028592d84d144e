"""The samples a sampling client made with ``record_stability_info=True`` draws, kept by the
engine (the same on every rank) so that a ``stable_reinforce`` datum's provenance can name
them: each sample by its ``sequence_id``, with its session, prompt, tokens and log-probs.

As Tinker's, a sample belongs to the session that drew it and can be trained on for a day
after it was drawn, each use restarting the day; a session's samples go with it, a session
keeps at most ``api.recorded_samples_per_session`` (its oldest go first) and all sessions
together ``api.recorded_samples_mb`` (the largest session's oldest go first). No torch.
"""

from __future__ import annotations

import dataclasses
import time
from array import array
from collections.abc import Sequence

from megatron_multilora.api.calls import OpError
from megatron_multilora.api.wire import Span

KEEP_S = 24 * 3600.0
PER_SESSION = 65536  # api.recorded_samples_per_session's default


@dataclasses.dataclass
class Recorded:
    prompt: array  # token ids ('i'), shared by the samples of one call
    tokens: array  # ('i')
    logprobs: array  # ('d')
    used: float  # time.monotonic() of its drawing or its last use


class RecordedSamples:
    """The kept samples, as compact arrays (4 bytes a token, 8 a log-prob); at most
    ``per_session`` a session and ``max_bytes`` in all (the largest session's oldest go)."""

    def __init__(self, per_session: int = PER_SESSION, max_bytes: int = 1 << 30) -> None:
        self.per_session, self.max_bytes = per_session, max_bytes
        # session -> sequence_id -> sample, oldest first: a session's samples are only ever
        # named by its own calls, and go with it.
        self.sessions: dict[str, dict[str, Recorded]] = {}
        self.bytes: dict[str, int] = {}  # a session's samples' bytes

    def record(
        self, session: str, prompt: list[int], samples: dict[str, tuple[list[int], list[float]]]
    ) -> None:
        """One sample call's samples (by sequence_id: tokens, log-probs) of ``prompt``."""
        now = time.monotonic()
        kept = self.sessions.setdefault(session, {})
        for key in [k for k, r in kept.items() if now - r.used > KEEP_S]:
            self._drop(session, key)
        shared = array("i", prompt)
        for sequence_id, (tokens, logprobs) in samples.items():
            if sequence_id in kept:
                self._drop(session, sequence_id)
            sample = Recorded(shared, array("i", tokens), array("d", logprobs), now)
            kept[sequence_id] = sample
            self.bytes[session] = self.bytes.get(session, 0) + _size(sample)
        for key in list(kept)[: max(0, len(kept) - self.per_session)]:
            self._drop(session, key)
        while sum(self.bytes.values()) > self.max_bytes:
            largest = max(self.bytes, key=self.bytes.__getitem__)
            self._drop(largest, next(iter(self.sessions[largest])))
            if not self.sessions[largest]:
                self.forget(largest)

    def forget(self, session: str) -> None:
        """The session has ended: its samples go."""
        self.sessions.pop(session, None)
        self.bytes.pop(session, None)

    def _drop(self, session: str, sequence_id: str) -> None:
        self.bytes[session] -= _size(self.sessions[session].pop(sequence_id))

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
                sample = self.sessions.get(session, {}).get(sequence_id)
                if sample is None or now - sample.used > KEEP_S:
                    raise OpError(
                        f"{where}: sequence_id {sequence_id!r} names no recorded sample of this "
                        "session (sample with record_stability_info=True, in this session, "
                        "within a day)"
                    )
                sample.used = now
                source = sample.prompt if kind == "prompt" else sample.tokens
                claimed = source[offset : offset + length].tolist()
                # Targets at prompt positions carry no sampler log-prob: a client may pad them.
                checked = field == "model_input" or kind == "sampled"
                if checked and list(own[position : position + length]) != claimed:
                    raise OpError(
                        f"{where}: {field} positions {position} to {position + length - 1} "
                        f"are not the {kind} tokens {offset} to {offset + length - 1} of "
                        f"sample {sequence_id!r}"
                    )
                if field == "targets" and kind == "sampled":
                    out[position : position + length] = sample.logprobs[
                        offset : offset + length
                    ].tolist()
                position += length
        return tuple(out)


def _size(sample: Recorded) -> int:
    """A sample's bytes: its tokens and log-probs, and its call's prompt (counted with each
    of the call's samples: an upper bound)."""
    return sum(a.itemsize * len(a) for a in (sample.prompt, sample.tokens, sample.logprobs))

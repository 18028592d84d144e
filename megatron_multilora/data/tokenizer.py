"""A byte-level tokenizer for tiny models, and the interface the dataset code expects."""

from __future__ import annotations

from typing import Iterable, Protocol

CHAT_ROLES = ("system", "user", "assistant")


class Tokenizer(Protocol):
    """What ``megatron_multilora.data.datasets`` needs from a tokenizer."""

    pad_id: int
    bos_id: int
    eos_id: int

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def encode_chat(self, messages: list[dict]) -> tuple[list[int], list[bool]]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: 0 = pad, 1 = bos, 2 = eos, byte ``b`` -> id ``b + 3``.

    Ids 259..263 exist only to pad the vocabulary to 264, a multiple of 8, so tensor-parallel
    sizes 2, 4 and 8 divide the embedding; they never come out of ``encode``.
    """

    pad_id = 0
    bos_id = 1
    eos_id = 2
    _offset = 3
    _end = 3 + 256  # first id past the byte range

    @property
    def vocab_size(self) -> int:
        """259 ids rounded up to a multiple of 8."""
        return (self._end + 7) // 8 * 8

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``'s UTF-8 bytes, no bos/eos."""
        return [b + self._offset for b in text.encode("utf-8")]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids in ``ids``; special and padding ids are skipped.

        Invalid UTF-8 (e.g. a model's half-generated character) becomes U+FFFD, not an error.
        """
        data = bytes(i - self._offset for i in ids if self._offset <= i < self._end)
        return data.decode("utf-8", errors="replace")

    def encode_chat(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        """Render ``[{"role", "content"}, ...]`` as ``bos <role>\\ncontent\\n ... eos``.

        Returns ``(ids, trained)``, two lists of equal length: ``trained[i]`` is True where
        ``ids[i]`` is something the model is trained to produce: an assistant message's
        content and its trailing newline, and the final eos. Role headers are never trained,
        so the model learns to answer, not to predict who speaks next.
        """
        if not isinstance(messages, list):
            raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
        ids, trained = [self.bos_id], [False]
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ValueError(f"message {i} must be a dict, got {type(message).__name__}")
            role, content = message.get("role"), message.get("content")
            if role not in CHAT_ROLES:
                raise ValueError(f"message {i}: unknown role {role!r}; expected one of {CHAT_ROLES}")
            if not isinstance(content, str):
                raise ValueError(
                    f"message {i}: content must be a string, got {type(content).__name__}")
            header, body = self.encode(f"<{role}>\n"), self.encode(f"{content}\n")
            ids += header + body
            trained += [False] * len(header) + [role == "assistant"] * len(body)
        ids.append(self.eos_id)
        trained.append(True)
        return ids, trained

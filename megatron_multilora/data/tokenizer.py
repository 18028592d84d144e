"""A byte-level tokenizer for tiny models, and the interface the dataset code expects."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

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
                raise ValueError(
                    f"message {i}: unknown role {role!r}; expected one of {CHAT_ROLES}"
                )
            if not isinstance(content, str):
                raise ValueError(
                    f"message {i}: content must be a string, got {type(content).__name__}"
                )
            header, body = self.encode(f"<{role}>\n"), self.encode(f"{content}\n")
            ids += header + body
            trained += [False] * len(header) + [role == "assistant"] * len(body)
        ids.append(self.eos_id)
        trained.append(True)
        return ids, trained


class HFTokenizer:
    """A Hugging Face tokenizer behind the :class:`Tokenizer` interface.

    Special tokens are added by the dataset code (bos/eos around each sample), so ``encode``
    adds none. A tokenizer without bos uses eos in its place; without pad, eos.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        if tokenizer.eos_token_id is None:
            raise ValueError(f"{type(tokenizer).__name__} has no eos token: cannot end samples")
        self.eos_id = int(tokenizer.eos_token_id)
        self.bos_id = int(
            tokenizer.bos_token_id if tokenizer.bos_token_id is not None else self.eos_id
        )
        self.pad_id = int(
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        )

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode_chat(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        """The tokenizer's chat template; loss on what each assistant turn adds to the text.

        Each message's tokens are found by rendering the conversation up to it and taking
        what was added, so the mask follows the template's own formatting.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"{type(self.tokenizer).__name__} has no chat template: use "
                "prompt/completion records"
            )
        ids: list[int] = []
        trained: list[bool] = []
        for i, message in enumerate(messages):
            if message.get("role") not in CHAT_ROLES:
                raise ValueError(f"unknown chat role {message.get('role')!r}; use {CHAT_ROLES}")
            rendered = self.tokenizer.apply_chat_template(messages[: i + 1], tokenize=True)
            # transformers 5 returns an encoding, 4.x a list of ids
            upto = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
            added = upto[len(ids) :]
            ids += added
            trained += [message["role"] == "assistant"] * len(added)
        return ids + [self.eos_id], trained + [True]

"""Sliced reads from a Hugging Face safetensors checkpoint folder.

A folder holds either ``model.safetensors`` or shards ``model-0000x-of-0000y.safetensors``
listed by ``model.safetensors.index.json``. Tensors are read through
``safe_open(...).get_slice(name)`` and indexed before they are materialised, so a rank only
reads the rows/columns (and experts) it holds.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import torch
from safetensors import safe_open

from megatron_multilora.errors import RunError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsFolder:
    """Tensor names, shapes and sliced reads of one checkpoint folder; use as a context
    manager (files are opened lazily and closed on exit). ``used`` records every name read.

    ``renamed``: (stored prefix, name prefix) pairs: a tensor stored as ``stored + rest`` is
    known as ``name + rest`` (a multimodal checkpoint's language model, stored below
    ``model.language_model.``, read as a causal LM's ``model.``)."""

    def __init__(self, folder: str, renamed: tuple[tuple[str, str], ...] = ()) -> None:
        self.folder = folder
        index = os.path.join(folder, INDEX_FILE)
        single = os.path.join(folder, SINGLE_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                self._file_of: dict[str, str] = dict(json.load(f)["weight_map"])
        elif os.path.isfile(single):
            with _opened(single) as f:
                self._file_of = {name: SINGLE_FILE for name in f.keys()}
        else:
            raise FileNotFoundError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        self._stored = {_renamed(name, renamed): name for name in self._file_of}
        self._file_of = {name: self._file_of[stored] for name, stored in self._stored.items()}
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        self.used: set[str] = set()

    def __enter__(self) -> SafetensorsFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._handles.clear()

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def _slice(self, name: str) -> Any:
        if name not in self._file_of:
            raise KeyError(name)
        file = self._file_of[name]
        if file not in self._handles:
            path = os.path.join(self.folder, file)
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{self.folder}: {INDEX_FILE} lists {file} for {name!r}, "
                    "but that file is missing"
                )
            self._handles[file] = self._stack.enter_context(_opened(path))
        try:
            return self._handles[file].get_slice(self._stored[name])
        except Exception as err:  # safetensors' own errors name neither the file nor a fix
            raise _damaged(os.path.join(self.folder, file), err) from None

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """``name``'s tensor, or only ``tensor[index]`` (one slice per leading dim) read from
        disk."""
        self.used.add(name)
        part = self._slice(name)
        try:
            return part[index] if index else part[:]
        except Exception as err:
            raise _damaged(os.path.join(self.folder, self._file_of[name]), err) from None


def _renamed(name: str, renamed: tuple[tuple[str, str], ...]) -> str:
    for stored, known in renamed:
        if name.startswith(stored):
            return known + name[len(stored) :]
    return name


@contextlib.contextmanager
def _opened(path: str):
    try:
        handle = safe_open(path, framework="pt")
    except Exception as err:
        raise _damaged(path, err) from None
    with handle as f:
        yield f


def _damaged(path: str, err: Exception) -> RunError:
    return RunError(
        f"{path} cannot be read ({type(err).__name__}: {err}): the file is damaged "
        "or incomplete; download or convert the model folder again"
    )

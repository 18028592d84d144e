"""What the HTTP side hands the engine: a call to run (:class:`Op`, plain data, the same on
every rank), the error a call that cannot run as asked gets, and the metadata a saved
training state carries. No torch: the front imports only this of the engine's side."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

STATE_META = "meta.json"


@dataclasses.dataclass
class Op:
    """One call to run: ``kind`` (a method of the engine), its future's id, and its
    arguments (plain data)."""

    kind: str
    request_id: str
    args: dict[str, Any]


class OpError(ValueError):
    """A call that cannot run as asked (answered to its client, the others go on)."""


def read_state_meta(folder: Path) -> dict:
    """A saved training state's metadata (its rank, its adapter's settings)."""
    try:
        return json.loads((folder / STATE_META).read_text())
    except (OSError, ValueError) as err:
        raise OpError(f"cannot read the training state {folder}: {err}") from None

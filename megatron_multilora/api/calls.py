"""What the HTTP side hands the engine: a call to run (:class:`Op`, plain data, the same on
every rank) of one of the kinds below, the error a call that cannot run as asked gets, and
the metadata a saved training state carries. No torch: the front imports only this of the
engine's side."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

STATE_META = "meta.json"

# The calls the engine runs (``Engine.calls`` maps each to its handler and its phase).
CREATE, FREE, SKIP = "create", "free", "skip"  # a client's slot; a refused call's place
FORWARD_BACKWARD, OPTIM_STEP = "forward_backward", "optim_step"
SAVE_STATE, LOAD_STATE, SAVE_FOR_SAMPLER = "save_state", "load_state", "save_for_sampler"
SAMPLE, RELEASE = "sample", "release"  # a sampling client's; sampler weights freed


@dataclasses.dataclass
class Op:
    """One call to run: ``kind`` (one of the kinds above), its future's id, and its
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

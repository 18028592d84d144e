"""Host-known values as a tensor on the compute device, without making the host wait.

``torch.tensor(values, device=cuda)`` copies from pageable memory, which waits for the copy
(and so for the device's queue) before the host goes on; a micro-batch's eager path makes a
few such tensors per layer call. From pinned memory the copy is queued like a kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def on_device(
    values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` as a 1-D ``dtype`` tensor on ``device``: on a GPU copied from pinned memory
    without waiting (the pinned buffer is kept alive by the copy's stream until it ran)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)

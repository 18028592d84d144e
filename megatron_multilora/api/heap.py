"""The service process's heap, handed back to the system.

A long-running service frees many buffers of varying sizes (each call's sequences, results
and samples); glibc keeps freed memory in its arenas, so the resident size creeps up though
nothing is kept. The launcher caps the arenas (``MALLOC_ARENA_MAX``: ``mmlora api``,
``SERVICE_ENV``), and the
status writer returns the arenas' free pages now and then (``malloc_trim``), as serving stacks
do. A no-op where the C library is not glibc. ``MMLORA_MALLOC_TRIM_S`` sets the trims'
period (0: none, with ``MALLOC_ARENA_MAX`` set to glibc's own default: the baseline the soak
benchmark, rows 17, compares against).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
import tracemalloc
from pathlib import Path

TRIM_EVERY_S = float(os.environ.get("MMLORA_MALLOC_TRIM_S", 30))
SNAPSHOTS = "MMLORA_HEAP_SNAPSHOTS"  # a folder: tracemalloc snapshots every SNAPSHOT_EVERY_S
SNAPSHOT_EVERY_S = 300.0
# Set by ``mmlora api`` for its processes (where not set already): few malloc arenas, and
# small GEMM caches. oneDNN, and torch's ideep above it, each keep a compiled primitive per
# GEMM shape (each micro-batch's token count is a new one) up to 1,024 by default, a few
# hundred KB each at SmolLM2-135M's widths; 256 keeps the shapes a service repeats
# (decoding) at a quarter of that.
SERVICE_ENV = {
    "MALLOC_ARENA_MAX": "2",
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256",
    "LRU_CACHE_CAPACITY": "256",
}


def _glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


def trim_heap() -> bool:
    """Return the heap's free pages to the system; whether anything was returned."""
    if _LIBC is None or TRIM_EVERY_S <= 0:
        return False
    return bool(_LIBC.malloc_trim(0))


class HeapSnapshots:
    """With ``MMLORA_HEAP_SNAPSHOTS=<folder>`` in the service's environment (a diagnostic,
    slow): Python's allocations traced from the start, a snapshot written every
    ``SNAPSHOT_EVERY_S`` (``minute-<m>.tracemalloc``); ``scripts/heap_diff.py`` compares
    two."""

    def __init__(self) -> None:
        folder = os.environ.get(SNAPSHOTS)
        self.folder = Path(folder) if folder else None
        self.start = self.last = time.monotonic()
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            tracemalloc.start(8)

    def maybe_take(self) -> None:
        if self.folder is None or time.monotonic() - self.last < SNAPSHOT_EVERY_S:
            return
        self.last = time.monotonic()
        minute = round((self.last - self.start) / 60)
        tracemalloc.take_snapshot().dump(str(self.folder / f"minute-{minute}.tracemalloc"))

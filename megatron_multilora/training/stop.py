"""Stopping a run safely: SIGTERM or SIGINT (Ctrl-C) asks for a stop at the next step boundary.

torchrun forwards either signal to every worker (and SIGKILLs them after its 30 s shutdown
timeout); a cluster scheduler may signal only some ranks, or signal them at different
moments. So a rank only records the signal, and at each step boundary all ranks agree
whether any got one: then they all save the same step and stop together. After a training
step the agreement rode in the step's first collective (``step.agree_step``: a signal that
arrives later in the step is acted on one step later); otherwise :func:`agreed_stop` runs one
all-reduce.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received = 0  # the stop signal this process got, 0 if none


class RunStopped(Exception):
    """Every rank stopped at step ``step`` for signal ``signum``; ``checkpoint`` resumes it."""

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; "
                         f"checkpoint {checkpoint}")


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, the first SIGTERM/SIGINT is only recorded (see :func:`agreed_stop`);
    a second one acts as it would without this (Ctrl-C twice interrupts at once)."""
    global _received
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def record(signum: int, frame) -> None:
        global _received
        _received = signum
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    for sig in STOP_SIGNALS:
        signal.signal(sig, record)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _received = 0


def received() -> int:
    """The stop signal this process received, 0 if none (not yet agreed with the others)."""
    return _received


def agreed_stop(device: torch.device) -> int:
    """At a step boundary (collective): the stop signal any rank received, 0 if none; the
    same value on every rank."""
    flag = torch.tensor([_received], dtype=torch.int32, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())

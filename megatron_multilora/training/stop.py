"""Stopping a run safely: SIGTERM or SIGINT (Ctrl-C), or ``mmlora stop``, asks for a stop at
the next step boundary.

torchrun forwards either signal to every worker (and SIGKILLs them after its 30 s shutdown
timeout); a cluster scheduler may signal only some ranks, or signal them at different
moments. So a rank only records the signal, and at each step boundary all ranks agree
whether any got one: then they all save the same step and stop together. After a training
step the agreement rode in the step's first collective (``step.agree_step``: a signal that
arrives later in the step is acted on one step later); otherwise ``step.agree_boundary`` runs
one all-reduce. A stop requested with ``mmlora stop`` travels the same way as the pseudo-signal
:data:`STOP_REQUESTED`.

Where nothing is left to save (the process starting, setup, the final evaluation: minutes on
a real model, past torchrun's 30 s), :func:`end_at_once_on_signals` ends the process at once
with its line instead, so a stop is always said.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_REQUESTED = 256  # above every signal number: a stop asked for by `mmlora stop`
_received = 0  # the stop signal this process got, 0 if none


class RunStopped(Exception):
    """Every rank stopped at step ``step`` for signal ``signum`` (or :data:`STOP_REQUESTED`);
    ``checkpoint`` resumes it."""

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        why = "on request (mmlora stop)" if self.requested else f"by {signal.Signals(signum).name}"
        super().__init__(f"stopped {why} after step {step}; checkpoint {checkpoint}")

    @property
    def requested(self) -> bool:
        return self.signum == STOP_REQUESTED

    @property
    def exit_code(self) -> int:
        """0 for a requested stop, else the shell's convention for "ended by this signal"."""
        return 0 if self.requested else 128 + self.signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, the first SIGTERM/SIGINT is only recorded (see :func:`received`);
    a second one acts as it would without this (Ctrl-C twice interrupts at once). A signal
    the block ends without honouring (no :class:`RunStopped`) stays recorded for what
    follows (:func:`end_at_once_on_signals`)."""
    global _received
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    _received = 0

    def record(signum: int, frame) -> None:
        global _received
        _received = signum
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    for sig in STOP_SIGNALS:
        signal.signal(sig, record)
    try:
        yield
    except RunStopped:
        _received = 0  # honoured
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def end_at_once_on_signals(end: Callable[[int], NoReturn]) -> Iterator[None]:
    """Within the block, SIGTERM/SIGINT call ``end(signum)``, which says so and exits; so does
    a signal recorded before it (by :func:`stop_on_signals`)."""
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    if _received:
        end(_received)
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: end(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def received() -> int:
    """The stop signal this process received, 0 if none (not yet agreed with the others)."""
    return _received


def exit_without_teardown() -> NoReturn:
    """End a process whose work is done with status 0: its exit handlers run, its streams are
    flushed, but Python's teardown of every imported module, most of a worker's exit with
    torch, megatron and transformers loaded, is skipped. Where another non-daemon
    thread still runs, the interpreter exits as usual (it waits for that thread)."""
    if any(
        t is not threading.main_thread() and not t.daemon and t.is_alive()
        for t in threading.enumerate()
    ):
        sys.exit(0)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def die_with_launcher() -> None:
    """A worker launched by torchrun gets SIGKILL when its launcher dies (Linux). torchrun
    starts each worker in a session of its own, so a launcher killed outright (SIGKILL, a
    crash) would otherwise leave its workers running: a service still holding its port."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() == 1:  # the launcher was gone already
        os.kill(os.getpid(), signal.SIGKILL)

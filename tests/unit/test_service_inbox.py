"""The training service's inbox: each client's calls in its order, one per batch, batches
shared across clients, bounded, and the batching window's rule (it waits for the last
batch's clients only)."""

import threading
import time

from megatron_multilora.service.engine import Op
from megatron_multilora.service.inbox import Inbox


def call(name: str) -> Op:
    return Op("forward_backward", name, {})


def names(batch: list[Op]) -> list[str]:
    return sorted(op.request_id for op in batch)


def test_a_clients_calls_run_in_its_order_one_per_batch_shared_with_others():
    inbox = Inbox(max_pending=16)
    inbox.start("a")
    inbox.start("b")
    inbox.put(call("a2"), "a", 2)  # arrives before its predecessor: waits for it
    assert inbox.take(timeout=0.05, window=0.0) == []
    inbox.put(call("a1"), "a", 1)
    inbox.put(call("b1"), "b", 1)
    assert names(inbox.take(timeout=1.0, window=0.0)) == ["a1", "b1"]
    assert names(inbox.take(timeout=1.0, window=0.0)) == ["a2"]


def test_the_inbox_is_bounded_but_a_forced_call_gets_in():
    inbox = Inbox(max_pending=2)
    assert inbox.put(call("x")) and inbox.put(call("y"))
    assert not inbox.put(call("z"))  # the front answers 429
    assert inbox.put(call("free"), force=True)
    assert len(inbox.take(timeout=1.0, window=0.0)) == 3
    assert inbox.put(call("z"))


def test_the_window_waits_for_the_last_batchs_clients_and_never_for_a_lone_one():
    # Each bound sits seconds away from the wrong behaviour's time (a window of 6 s waited
    # out), so a loaded 2-core machine's late thread wake-ups cannot decide it.
    window = 6.0
    inbox = Inbox(max_pending=16)
    inbox.start("a")
    inbox.put(call("a1"), "a", 1)
    start = time.monotonic()
    assert names(inbox.take(timeout=1.0, window=window)) == ["a1"]
    inbox.put(call("a2"), "a", 2)
    assert names(inbox.take(timeout=1.0, window=window)) == ["a2"]
    assert time.monotonic() - start < window / 2  # a lone client: no window
    inbox.start("b")
    inbox.put(call("a3"), "a", 3)
    inbox.put(call("b1"), "b", 1)
    assert names(inbox.take(timeout=1.0, window=window)) == ["a3", "b1"]
    # a's next call is ready, b's comes 0.2 s later: the batch waits for it (not the window).
    inbox.put(call("a4"), "a", 4)
    threading.Timer(0.2, lambda: inbox.put(call("b2"), "b", 2)).start()
    start = time.monotonic()
    assert names(inbox.take(timeout=1.0, window=window)) == ["a4", "b2"]
    assert 0.15 < time.monotonic() - start < window / 2
    # b does not call again: a's call waits a window of 0.3 s out, then runs alone.
    inbox.put(call("a5"), "a", 5)
    start = time.monotonic()
    assert names(inbox.take(timeout=window, window=0.3)) == ["a5"]
    assert 0.25 < time.monotonic() - start < window / 2

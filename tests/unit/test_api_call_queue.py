"""The training service's calls: each client's calls in its order, one per batch, batches
shared across clients, bounded, and the batching window's rule (it waits for the last
batch's clients only)."""

import threading
import time

from megatron_multilora.api.call_queue import CallQueue
from megatron_multilora.api.calls import Op


def call(name: str) -> Op:
    return Op("forward_backward", name, {})


def names(batch: list[Op]) -> list[str]:
    return sorted(op.request_id for op in batch)


def test_a_clients_calls_run_in_its_order_one_per_batch_shared_with_others():
    calls = CallQueue(max_pending=16)
    calls.start("a")
    calls.start("b")
    calls.put(call("a2"), "a", 2)  # arrives before its predecessor: waits for it
    assert calls.take(timeout=0.05, window=0.0) == []
    calls.put(call("a1"), "a", 1)
    calls.put(call("b1"), "b", 1)
    assert names(calls.take(timeout=1.0, window=0.0)) == ["a1", "b1"]
    assert names(calls.take(timeout=1.0, window=0.0)) == ["a2"]


def test_the_queue_is_bounded_but_a_forced_call_gets_in():
    calls = CallQueue(max_pending=2)
    assert calls.put(call("x")) and calls.put(call("y"))
    assert not calls.put(call("z"))  # the front answers 429
    assert calls.put(call("free"), force=True)
    assert len(calls.take(timeout=1.0, window=0.0)) == 3
    assert calls.put(call("z"))


def test_the_window_waits_for_the_last_batchs_clients_and_never_for_a_lone_one():
    # Each bound sits seconds away from the wrong behaviour's time (a window of 6 s waited
    # out), so a loaded 2-core machine's late thread wake-ups cannot decide it.
    window = 6.0
    calls = CallQueue(max_pending=16)
    calls.start("a")
    calls.put(call("a1"), "a", 1)
    start = time.monotonic()
    assert names(calls.take(timeout=1.0, window=window)) == ["a1"]
    calls.put(call("a2"), "a", 2)
    assert names(calls.take(timeout=1.0, window=window)) == ["a2"]
    assert time.monotonic() - start < window / 2  # a lone client: no window
    calls.start("b")
    calls.put(call("a3"), "a", 3)
    calls.put(call("b1"), "b", 1)
    assert names(calls.take(timeout=1.0, window=window)) == ["a3", "b1"]
    # a's next call is ready, b's comes 0.2 s later: the batch waits for it (not the window).
    calls.put(call("a4"), "a", 4)
    threading.Timer(0.2, lambda: calls.put(call("b2"), "b", 2)).start()
    start = time.monotonic()
    assert names(calls.take(timeout=1.0, window=window)) == ["a4", "b2"]
    assert 0.15 < time.monotonic() - start < window / 2
    # b does not call again: a's call waits a window of 0.3 s out, then runs alone.
    calls.put(call("a5"), "a", 5)
    start = time.monotonic()
    assert names(calls.take(timeout=window, window=0.3)) == ["a5"]
    assert 0.25 < time.monotonic() - start < window / 2


def test_the_window_waits_for_the_keys_that_sampled_in_the_last_batch():
    """Tenants' samples share a generation pass: a key that sampled in the last batch is
    waited for (within the window) when another key's call is ready."""
    window = 6.0
    calls = CallQueue(max_pending=16, keys=2)
    calls.put(Op("sample", "a1", {}), owner="key-a")
    calls.put(Op("sample", "b1", {}), owner="key-b")
    assert names(calls.take(timeout=1.0, window=0.0)) == ["a1", "b1"]
    calls.put(Op("sample", "a2", {}), owner="key-a")
    threading.Timer(0.2, lambda: calls.put(Op("sample", "b2", {}), owner="key-b")).start()
    start = time.monotonic()
    assert names(calls.take(timeout=1.0, window=window)) == ["a2", "b2"]
    assert time.monotonic() - start < window / 2  # b's call ended the wait, not the window

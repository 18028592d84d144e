"""The training service's results: fetched again while kept, forgotten after KEEP_S."""

import asyncio
import json

from megatron_multilora.api import futures
from megatron_multilora.api.futures import JSON, Futures, Result


def test_results_are_kept_for_a_while_then_forgotten(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(futures.time, "monotonic", lambda: clock[0])
    loop = asyncio.new_event_loop()
    try:
        store = Futures(loop)
        first = store.new("alice")
        store.complete(first, Result(JSON, {"n": 1}))
        clock[0] += futures.KEEP_S / 2
        second = store.new("alice")  # prunes nothing yet
        for _ in range(2):  # fetched twice: the same result
            assert loop.run_until_complete(store.wait(first, 1.0)).payload == {"n": 1}
        store.complete(second, Result(JSON, {"n": 2}))
        clock[0] += futures.KEEP_S / 2 + 1
        store.new("bob")  # the first is now older than KEEP_S; the second is not
        assert store.owner(first) is None and store.owner(second) == "alice"
        assert loop.run_until_complete(store.wait(second, 1.0)).payload == {"n": 2}
    finally:
        loop.close()


def test_kept_results_are_bounded_by_bytes_oldest_first():
    loop = asyncio.new_event_loop()
    try:
        one = len(json.dumps({"n": 0}))
        store = Futures(loop, max_bytes=2 * one)
        ids = [store.new("alice") for _ in range(3)]
        for n, request_id in enumerate(ids):
            store.complete(request_id, Result(JSON, {"n": n}))
        assert store.owner(ids[0]) is None  # the oldest went
        assert store.kept() == {"alice": [0, 2, 2 * one]} and store.kept_bytes == 2 * one
        assert loop.run_until_complete(store.wait(ids[2], 1.0)).payload == {"n": 2}
    finally:
        loop.close()

"""The service's front on its own (no engine): what a refused call leaves behind."""

import asyncio
import json
import time

import pytest

from megatron_multilora.api.call_queue import CallQueue
from megatron_multilora.api.front import Front
from megatron_multilora.api.futures import Futures
from megatron_multilora.api.ops import Op
from megatron_multilora.api.request_checks import Limits, Refused

OWNER = "key-a"


class Body:
    """What the front reads of an HTTP request: its body."""

    def __init__(self, fields: dict) -> None:
        self._body = json.dumps(fields).encode()

    async def body(self) -> bytes:
        return self._body


def create(front: Front, loop, session: str, seq: int):
    request = {  # tinker's CreateModelRequest, as the SDK sends it
        "session_id": session,
        "model_seq_id": seq,
        "base_model": "tiny",
        "lora_config": {"rank": 4},
    }
    return loop.run_until_complete(front.create_model(Body(request), OWNER))


def test_a_creation_answered_429_holds_no_slot(tmp_path):
    loop = asyncio.new_event_loop()
    calls = CallQueue(max_pending=2)
    limits = Limits("tiny", 64, 128, slots=2, max_rank=8, tokenizer_id=None)
    front = Front({"tml-a": OWNER}, limits, tmp_path, calls, Futures(loop), 60.0)
    front.sessions["s"] = (OWNER, time.monotonic())
    assert calls.put(Op("sample", "r0", {})) and calls.put(Op("sample", "r1", {}))  # full
    for seq in range(3):  # more refusals than slots
        with pytest.raises(Refused) as err:
            create(front, loop, "s", seq)
        assert err.value.status == 429
    assert front.clients == {}
    assert calls.take(timeout=1.0, window=0.0)  # the queue drains
    created = [create(front, loop, "s", seq) for seq in (3, 4)]  # both slots are free
    assert sorted(c.slot for c in front.clients.values()) == [0, 1]
    assert all(c["model_id"] in front.clients for c in created)
    loop.close()

"""The service's front on its own (no engine): what a refused call leaves behind."""

import asyncio
import json
import os
import platform
import time
from pathlib import Path

import pytest

from megatron_multilora.api.call_queue import CallQueue
from megatron_multilora.api.calls import Op
from megatron_multilora.api.front import Front
from megatron_multilora.api.futures import Futures
from megatron_multilora.api.request_checks import Limits, Refused
from megatron_multilora.api.training_front import TrainingEndpoints

OWNER = "key-a"


class Body:
    """What the front reads of an HTTP request: its body."""

    def __init__(self, fields: dict) -> None:
        self._body = json.dumps(fields).encode()

    async def body(self) -> bytes:
        return self._body


def create(front: Front, loop, session: str, seq: int, owner: str = OWNER):
    request = {  # tinker's CreateModelRequest, as the SDK sends it
        "session_id": session,
        "model_seq_id": seq,
        "base_model": "tiny",
        "lora_config": {"rank": 4},
    }
    return loop.run_until_complete(TrainingEndpoints(front).create_model(Body(request), owner))


def test_a_creation_answered_429_holds_no_slot(tmp_path):
    loop = asyncio.new_event_loop()
    calls = CallQueue(max_pending=2)
    limits = Limits("tiny", 64, 128, slots=2, max_rank=8, tokenizer_id=None, unembed=True)
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


def serving(tmp_path, keys: int = 1, max_pending: int = 64):
    """A front with one session per key (``key-0``, ...) and its queue, on a fresh loop."""
    loop = asyncio.new_event_loop()
    calls = CallQueue(max_pending=max_pending, keys=keys)
    limits = Limits("tiny", 64, 128, slots=4, max_rank=8, tokenizer_id=None, unembed=True)
    owners = {f"tml-{k}": f"key-{k}" for k in range(keys)}
    front = Front(owners, limits, tmp_path, calls, Futures(loop), 60.0)
    for k in range(keys):
        front.sessions[f"s{k}"] = (f"key-{k}", time.monotonic())
    return front, calls, loop


def call(loop, endpoint, owner: str, **fields):
    return loop.run_until_complete(endpoint(Body(fields), owner))


def test_a_resent_save_or_creation_gets_the_first_ones_future(tmp_path):
    """The SDK resends a call it heard nothing of, with the same ids: the first call's
    future, not 400 "exists" (and nothing queued twice)."""
    from megatron_multilora.api.weights_front import WeightsEndpoints

    front, calls, loop = serving(tmp_path)
    first = create(front, loop, "s0", 0, owner="key-0")
    assert create(front, loop, "s0", 0, owner="key-0") == first
    weights = WeightsEndpoints(front)
    save = dict(model_id=first["model_id"], path="ckpt", seq_id=1)
    answers = [call(loop, weights.save_weights, "key-0", **save) for _ in range(2)]
    assert answers[0] == answers[1]
    assert sorted(op.kind for op in calls.take(timeout=1.0, window=0.0)) == [
        "create",
        "save_state",
    ]
    assert calls.take(timeout=0.05, window=0.0) == []


def test_a_checkpoint_is_listed_once_written_and_expires_with_its_ttl(tmp_path):
    from megatron_multilora.api.weights_front import WeightsEndpoints

    front, _, loop = serving(tmp_path)
    model_id = create(front, loop, "s0", 0, owner="key-0")["model_id"]
    weights = WeightsEndpoints(front)
    saved = call(
        loop, weights.save_weights, "key-0", model_id=model_id, path="a", seq_id=1, ttl_seconds=1
    )
    assert front.checkpoints.owned("key-0") == []  # queued, not written: not listed
    with pytest.raises(Refused, match="still being written"):
        front.checkpoints.get("key-0", f"tinker://{model_id}/weights/a", "weights")
    assert not (tmp_path / "api" / "checkpoints.json").exists()
    folder = Path(front.checkpoints.entries[f"tinker://{model_id}/weights/a"]["folder"])
    folder.mkdir(parents=True)  # the engine writes it, then its call is answered
    front.checkpoints.settle(saved["request_id"], written=True)
    (listed,) = front.checkpoints.owned("key-0")
    assert listed.expires_at is not None and listed.tinker_path.endswith("/weights/a")
    time.sleep(1.1)
    assert front.checkpoints.owned("key-0") == []  # expired: no longer listed
    front.checkpoints.expire()
    assert not folder.exists() and json.loads((tmp_path / "api/checkpoints.json").read_text()) == {}
    failed = call(loop, weights.save_weights, "key-0", model_id=model_id, path="b", seq_id=2)
    front.checkpoints.settle(failed["request_id"], written=False)  # its save failed: gone
    assert f"tinker://{model_id}/weights/b" not in front.checkpoints


def test_a_key_keeps_a_bounded_number_of_checkpoints(tmp_path):
    from megatron_multilora.api.weights_front import WeightsEndpoints

    front, _, loop = serving(tmp_path)
    front.checkpoints.max_saves = 2
    model_id = create(front, loop, "s0", 0, owner="key-0")["model_id"]
    weights = WeightsEndpoints(front)
    for seq in (1, 2):
        call(loop, weights.save_weights, "key-0", model_id=model_id, path=f"c{seq}", seq_id=seq)
    with pytest.raises(Refused, match="keeps 2 checkpoints, the most it may") as err:
        call(loop, weights.save_weights, "key-0", model_id=model_id, path="c3", seq_id=3)
    assert err.value.status == 400


def test_samplers_and_their_weights_go_with_their_session_and_are_bounded(tmp_path):
    from megatron_multilora.api import checkpoint_index
    from megatron_multilora.api.weights_front import WeightsEndpoints

    front, calls, loop = serving(tmp_path)
    model_id = create(front, loop, "s0", 0, owner="key-0")["model_id"]
    weights = WeightsEndpoints(front)
    made = []
    for seq in range(1, checkpoint_index.MAX_EPHEMERAL + 2):  # one more than a key keeps
        answer = call(
            loop,
            weights.save_weights_for_sampler,
            "key-0",
            model_id=model_id,
            sampling_session_seq_id=seq,
            seq_id=seq,
        )
        front.checkpoints.settle(answer["request_id"], written=True)
        made.append(f"s0:sample:{seq}")
    assert sorted(front.samplers) == sorted(made[1:])  # the oldest went (its weights too)
    ops = [op for op in calls.take(timeout=1.0, window=0.0)]
    (release,) = [op for op in ops if op.kind == "release"]
    assert len(release.args["folders"]) == 1 and "sampler-1" in release.args["folders"][0]
    with front.lock:
        front._end_sessions({"s0"})
    assert front.samplers == {} and front.checkpoints.owned("key-0") == []
    ops = []
    while batch := calls.take(timeout=0.05, window=0.0):
        ops += batch
    (release,) = [op for op in ops if op.kind == "release"]
    assert release.args["session"] == "s0" and len(release.args["folders"]) == 8


def test_one_key_cannot_fill_the_queue_or_run_ahead_of_its_order(tmp_path):
    """A flood of calls far ahead of a client's next one is refused (400), a key beyond its
    share of the queue gets 429, and another key's calls still get in; a refused call with a
    stale seq_id leaves nothing in the queue."""
    from megatron_multilora.api.call_queue import MAX_AHEAD

    front, calls, loop = serving(tmp_path, keys=2, max_pending=8)
    a = front.clients[create(front, loop, "s0", 0, owner="key-0")["model_id"]]
    b = front.clients[create(front, loop, "s1", 0, owner="key-1")["model_id"]]
    calls.take(timeout=1.0, window=0.0)  # the creations
    with pytest.raises(Refused, match=f"calls ahead of its next call .1.; at most {MAX_AHEAD}"):
        front.submit("key-0", "skip", {}, a, 1 + MAX_AHEAD)
    for seq in (1, 2, 3, 4):  # key-0's share: 8 // 2
        front.submit("key-0", "optim_step", {}, a, seq)
    with pytest.raises(Refused, match="its share of the queue") as err:
        front.submit("key-0", "optim_step", {}, a, 5)
    assert err.value.status == 429
    front.submit("key-1", "optim_step", {}, b, 1)  # the other key gets in
    assert len(calls.take(timeout=1.0, window=0.0)) == 2  # one call per client per batch

    def bad() -> tuple:
        raise Refused(400, "a bad datum")

    with pytest.raises(Refused, match="a bad datum"):  # at a stale seq_id: no placeholder
        front.in_order("key-0", a, 0, bad)
    assert sorted(calls._ordered[a.model_id]) == [2, 3, 4]
    with pytest.raises(Refused, match="has been queued already") as err:
        front.submit("key-0", "optim_step", {}, a, 0)
    assert err.value.status == 400


def test_metadata_a_client_sends_is_bounded(tmp_path):
    front, _, loop = serving(tmp_path)
    request = {
        "session_id": "s0",
        "model_seq_id": 0,
        "base_model": "tiny",
        "lora_config": {"rank": 4},
        "user_metadata": {"blob": "x" * 20000},
    }
    with pytest.raises(Refused, match="the service keeps up to"):
        loop.run_until_complete(TrainingEndpoints(front).create_model(Body(request), "key-0"))
    assert front.clients == {}


def test_an_optimizer_the_service_does_not_run_is_refused_at_creation(tmp_path):
    front, calls, loop = serving(tmp_path)
    request = {
        "session_id": "s0",
        "model_seq_id": 0,
        "base_model": "tiny",
        "lora_config": {"rank": 4},
        "optimizer_config": {"type": "dimuon", "version": 1},  # types.DimuonOptimizerConfig()
    }
    with pytest.raises(Refused, match="optimizer 'dimuon': not served") as err:
        loop.run_until_complete(TrainingEndpoints(front).create_model(Body(request), "key-0"))
    assert err.value.status == 400 and front.clients == {}
    assert calls.take(timeout=0.05, window=0.0) == []
    request["optimizer_config"] = {"type": "adamw"}
    assert create(front, loop, "s0", 1, owner="key-0")["model_id"] in front.clients


def test_clients_beyond_the_slots_get_numbers_up_to_the_bound_then_429(tmp_path):
    """Two device slots, three clients at most (api.max_training_clients): the third gets a
    number beyond the slots (the engine pages it), the fourth a 429 naming the setting; a
    refused creation's number is given again."""
    loop = asyncio.new_event_loop()
    limits = Limits("tiny", 64, 128, 2, 8, None, unembed=True, clients=3)
    front = Front({"tml-a": OWNER}, limits, tmp_path, CallQueue(64), Futures(loop), 60.0)
    front.sessions["s"] = (OWNER, time.monotonic())
    for seq in range(3):
        create(front, loop, "s", seq)
    assert sorted(c.slot for c in front.clients.values()) == [0, 1, 2]
    with pytest.raises(Refused) as err:
        create(front, loop, "s", 3)
    assert err.value.status == 429 and "api.max_training_clients" in str(err.value)
    assert len(front.clients) == 3
    loop.close()


@pytest.mark.parametrize(
    "name,problem",
    [("a\x00b", "control characters"), ("x" * 5000, "5000 bytes"), ("../up", "no '/'")],
    ids=["nul", "5000_chars", "dot_dot"],
)
def test_a_checkpoint_name_the_filesystem_cannot_take_is_refused_at_the_front(
    tmp_path, name, problem
):
    """Refused with a 400 naming the rule before anything is queued or indexed (it used to
    fail in the engine with the server's path in the answer)."""
    from megatron_multilora.api.weights_front import WeightsEndpoints

    front, calls, loop = serving(tmp_path)
    model_id = create(front, loop, "s0", 0, owner="key-0")["model_id"]
    queued = calls.waiting
    weights = WeightsEndpoints(front)
    for seq, endpoint in enumerate((weights.save_weights, weights.save_weights_for_sampler)):
        with pytest.raises(Refused, match=problem) as err:
            call(loop, endpoint, "key-0", model_id=model_id, path=name, seq_id=seq + 1)
        assert err.value.status == 400 and str(tmp_path) not in str(err.value)
    # nothing indexed; only the refused calls' places in the client's order (skips)
    assert front.checkpoints.entries == {} and calls.waiting == queued + 2


def test_a_failed_calls_answer_shows_no_server_path(tmp_path):
    """The engine's error can name a folder under the run (an OSError's file name): the
    client's answer says ``<server path>`` instead; the service's log keeps the path."""
    from megatron_multilora.api.futures import ERROR, Result

    logged: list[str] = []
    front, _, loop = serving(tmp_path)
    front.say = logged.append
    request_id = front.futures.new("key-0")
    folder = f"{tmp_path}/api/key-0/s0_train_0/weights/x"
    front.answer(request_id, Result(ERROR, (f"OSError: [Errno 36] too long: '{folder}'", "user")))
    message, _ = loop.run_until_complete(front.futures.wait(request_id, 1.0)).payload
    assert message == "OSError: [Errno 36] too long: '<server path>'"
    assert folder in logged[0]


def test_what_the_service_keeps_is_accounted_per_tenant_and_in_all(tmp_path):
    """Sessions, clients, results and their bytes, recorded samples, queued calls: each
    tenant's own, the totals their sums, every structure with its bound."""
    from types import SimpleNamespace

    from megatron_multilora.api.futures import JSON, Result
    from megatron_multilora.api.memory import BOUNDS, service_memory
    from megatron_multilora.api.recorded_samples import RecordedSamples
    from megatron_multilora.cli.jobs import _memory

    front, calls, loop = serving(tmp_path, keys=2)
    create(front, loop, "s0", 0, owner="key-0")
    create(front, loop, "s1", 0, owner="key-1")
    done = front.futures.new("key-1")
    front.futures.complete(done, Result(JSON, {"loss": 1.5}))
    engine = SimpleNamespace(table=SimpleNamespace(pages={}), recorded=RecordedSamples())
    engine.recorded.record("s1", [1, 2], {"r:0": ([3], [-0.5])})
    memory = service_memory(front, engine)
    tenants, in_all = memory["tenants"], memory["in_all"]
    assert tenants["key-0"]["sessions"] == 1 and tenants["key-0"]["training_clients"] == 1
    assert tenants["key-1"]["results"] == [1, len('{"loss": 1.5}')]
    assert tenants["key-1"]["recorded_samples"] == [1, 4 * 2 + 4 + 8]
    assert tenants["key-0"]["queue"] == calls.waiting_of("key-0") == 1  # its creation
    assert in_all["sessions"]["count"] == 2 and in_all["queue"]["count"] == calls.waiting
    assert set(BOUNDS) <= set(in_all) and all("bound" in row for row in in_all.values())
    held = front.limits.max_clients
    assert in_all["training_clients"]["bound"] == f"{held} (api.max_training_clients)"
    front.memory = memory
    health = loop.run_until_complete(front.healthz(None, None))
    assert health["memory"] == in_all and "key-0" not in json.dumps(health)
    shown = _memory({"trainer": {"memory": memory}})
    assert shown[0].startswith("memory: ") and "sessions 2" in shown[0]
    assert any(line.startswith("  key-1: ") and "recorded samples 1" in line for line in shown)


def test_a_key_holds_a_bounded_number_of_sessions(tmp_path):
    front, _, loop = serving(tmp_path)  # key-0 holds s0
    front.max_sessions = 2
    request = dict(tags=[], user_metadata=None, sdk_version="0.38.0")  # as the SDK sends it
    call(loop, front.create_session, "key-0", **request)
    with pytest.raises(Refused, match=r"holds 2 open sessions.*api\.max_sessions") as err:
        call(loop, front.create_session, "key-0", **request)
    assert err.value.status == 429 and len(front.sessions) == 2


def test_heap_snapshots_are_taken_on_request(tmp_path, monkeypatch):
    """``MMLORA_HEAP_SNAPSHOTS``: traced from the start, a snapshot every interval, which
    ``scripts/heap_diff.py`` reads."""
    import subprocess
    import sys
    import tracemalloc

    from megatron_multilora.api import heap

    monkeypatch.setenv(heap.SNAPSHOTS, str(tmp_path / "heap"))
    monkeypatch.setattr(heap, "SNAPSHOT_EVERY_S", 0.0)
    snapshots = heap.HeapSnapshots()
    try:
        snapshots.maybe_take()
        kept = [bytearray(1 << 20) for _ in range(3)]  # 3 MiB more
        time.sleep(0.01)
        snapshots.start -= 60  # the second snapshot a minute later
        snapshots.maybe_take()
    finally:
        tracemalloc.stop()
    first, second = sorted((tmp_path / "heap").iterdir())
    out = subprocess.run(
        [sys.executable, "scripts/heap_diff.py", str(first), str(second)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "Python heap: +3." in out and "test_api_front.py" in out
    del kept


def test_the_heap_is_trimmed_unless_its_period_is_zero():
    """``MMLORA_MALLOC_TRIM_S=0`` turns the trims off (the soak's baseline); by default a
    trim runs every 30 s and, on glibc, returns freed pages."""
    import subprocess
    import sys

    probe = (
        "from megatron_multilora.api import heap; "
        "big = [bytearray(1 << 16) for _ in range(2000)]; del big[::2]; "
        "print(heap.TRIM_EVERY_S, heap.trim_heap())"
    )
    off, default = (
        subprocess.run(
            [sys.executable, "-c", probe],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        for env in ({"MMLORA_MALLOC_TRIM_S": "0"}, {})
    )
    assert off == ["0.0", "False"]
    assert default[0] == "30.0"
    if platform.libc_ver()[0] == "glibc":
        assert default[1] == "True"


def test_mmlora_api_launches_with_the_services_allocator_settings(monkeypatch):
    """``mmlora api`` sets ``SERVICE_ENV`` (few malloc arenas, small GEMM primitive caches)
    for the processes it launches, unless the environment sets them already."""
    import argparse

    from megatron_multilora.api.heap import SERVICE_ENV
    from megatron_multilora.cli import api as cli_api

    seen = {}
    monkeypatch.setattr(cli_api, "train", lambda args: seen.update(os.environ) or 0)
    for name in SERVICE_ENV:  # unset here, and as it was after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")  # the user's own value wins
    args = argparse.Namespace(keys_file=None, overrides=[], run_dir="r", port=0, host="127.0.0.1")
    assert cli_api.api(args) == 0
    assert seen["MALLOC_ARENA_MAX"] == "4"
    for cache in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):  # oneDNN's, ideep's
        assert seen[cache] == SERVICE_ENV[cache] == "256"


def test_paged_clients_are_held_only_as_far_as_their_pages_fit_host_memory(tmp_path):
    """api.max_training_clients beyond lora.slots costs a page each, and the slots' reused
    buffers a page each: held_clients keeps the count where those fit api.paged_adapters_mb
    (or half the memory available), else holds the slots plus the pages that fit, and says
    why; the 429 then names the memory bound."""
    from megatron_multilora.api.host_memory import held_clients

    mib = 2**20
    assert held_clients(256, 4, 2 * mib, None, 1024 * mib) == (256, None)  # 512 MiB: 256 fit
    assert held_clients(256, 4, 2 * mib, None, 1022 * mib)[0] == 255
    clients, why = held_clients(256, 4, 148 * mib, None, 24 * 1024 * mib)
    assert clients == 12288 // 148  # half of 24 GiB in 148 MiB pages, 4 of them the slots'
    assert "(null: half the 24,576 MiB available, 12,288 MiB) fits 79 pages" in why
    assert "so the service holds 83 training clients at once" in why
    assert held_clients(256, 4, 148 * mib, 1000.0, None)[0] == 6  # set: 6 pages, 2 beyond
    assert held_clients(256, 4, 148 * mib, 1.0, None)[0] == 4  # never fewer than the slots
    assert held_clients(256, 4, 148 * mib, None, None) == (256, None)  # nothing to measure by
    assert held_clients(3, 4, 148 * mib, 1.0, None) == (3, None)  # none paged
    loop = asyncio.new_event_loop()
    bound = "api.paged_adapters_mb, host memory for paged clients"
    limits = Limits("tiny", 64, 128, 2, 8, None, True, clients=2, clients_bound=bound)
    front = Front({"tml-a": OWNER}, limits, tmp_path, CallQueue(64), Futures(loop), 60.0)
    front.sessions["s"] = (OWNER, time.monotonic())
    create(front, loop, "s", 0)
    create(front, loop, "s", 1)
    with pytest.raises(Refused) as err:
        create(front, loop, "s", 2)
    assert err.value.status == 429 and bound in str(err.value)
    loop.close()


def _files(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_host_memory_available_is_the_least_of_meminfo_and_each_memory_cgroup(tmp_path):
    """A cgroup's room is its limit less its usage, its inactive page cache counted as free,
    for every cgroup from the process's own up (v2), or its namespace's own (v1, where the
    path /proc shows is the host's); never below 0; None where nothing can be read."""
    from megatron_multilora.api.host_memory import available_host_bytes

    gib = 2**30
    meminfo = "MemTotal:       25165824 kB\nMemAvailable:   20971520 kB\n"  # 20 GiB
    v2 = _files(
        tmp_path / "v2",
        {
            "proc/meminfo": meminfo,
            "proc/self/cgroup": "0::/user.slice/svc\n",
            "sys/fs/cgroup/user.slice/svc/memory.max": "max\n",
            "sys/fs/cgroup/user.slice/svc/memory.current": str(6 * gib),
            "sys/fs/cgroup/user.slice/memory.max": str(8 * gib),
            "sys/fs/cgroup/user.slice/memory.current": str(7 * gib),
            "sys/fs/cgroup/user.slice/memory.stat": f"anon 1\ninactive_file {2 * gib}\n",
        },
    )
    assert available_host_bytes(v2) == 3 * gib  # the slice's: 8 - 7 + 2
    v1 = _files(
        tmp_path / "v1",
        {
            "proc/meminfo": meminfo,
            "proc/self/cgroup": "5:cpu:/\n4:memory:/docker/abc\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": str(2 * gib),
            "sys/fs/cgroup/memory/memory.usage_in_bytes": str(3 * gib),
            "sys/fs/cgroup/memory/memory.stat": "total_inactive_file 0\n",
        },
    )
    assert available_host_bytes(v1) == 0  # over its limit
    unlimited = _files(tmp_path / "unlimited", {"proc/meminfo": meminfo})
    assert available_host_bytes(unlimited) == 20 * gib
    assert available_host_bytes(tmp_path / "nothing") is None
    assert 0 <= available_host_bytes() < os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

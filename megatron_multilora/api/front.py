"""The HTTP front the ``tinker`` SDK talks to: what each endpoint checks (the caller's key,
that what it names is its own, the request against the run's limits) before a call goes to
the engine's call queue, and the answers.

Bad requests get a 4xx with the reason before anything changes; a call failing as it runs
answers ``{"error", "category"}`` (the SDK raises ``RequestFailedError``). Training
clients are ``<session>:train:<n>``, samplers ``<session>:sample:<n>``, checkpoints
``tinker://<client>/<weights|sampler_weights>/<name>`` (``checkpoint_index.py``).
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from tinker import types

from megatron_multilora.api import wire
from megatron_multilora.api.call_queue import CallQueue
from megatron_multilora.api.calls import (
    FREE,
    RELEASE,
    SKIP,
    Op,
)
from megatron_multilora.api.checkpoint_index import CheckpointIndex
from megatron_multilora.api.futures import ERROR, KEEP_S, PROTOBUF, Futures, Result
from megatron_multilora.api.request_checks import (
    CLIENT_CONFIG,
    Limits,
    Refused,
    refusal,
)

RESEND_WINDOW = 256  # a client's calls whose resend is recognised: its last ones
MAX_BODY = 4 << 20  # a JSON request's bytes (forward_backward's protobuf is read apart)
MAX_METADATA = 16 << 10  # the user_metadata and tags a client's session or model keeps


# An absolute filesystem path in a message (not a tinker:// path's parts): the server's own,
# which its answers do not show (its log does).
_SERVER_PATH = re.compile(r"(?<![\w:/.])/(?:[^\s'\"/]+/)*[^\s'\"/]+")


def without_server_paths(message: str) -> str:
    """``message`` with the server's filesystem paths replaced by ``<server path>``."""
    return _SERVER_PATH.sub("<server path>", message)


@dataclasses.dataclass
class Client:
    model_id: str
    owner: str
    session_id: str
    slot: int  # its adapter's number in the engine's table (a device slot or a page)
    rank: int
    user_metadata: dict | None = None
    creation: str = ""  # its creation's request id (a resent creation gets it)


@dataclasses.dataclass
class Sampler:
    sampler_id: str  # <session>:sample:<n>
    owner: str
    folder: str | None  # its sampler weights; None: the base model
    ephemeral: bool = False  # save_weights_and_get_sampling_client's: its weights go with it

    @property
    def session_id(self) -> str:
        return self.sampler_id.rsplit(":sample:", 1)[0]


class Front:
    """The endpoints; ``calls`` queues the calls for the engine, ``futures`` their results."""

    def __init__(
        self,
        keys: dict[str, str],
        limits: Limits,
        run_dir: Path,
        calls: CallQueue,
        futures: Futures,
        session_timeout: float,
        max_saves: int = 1000,
        say: Callable[[str], None] = lambda line: None,
        max_sessions: int = 1024,
        max_samplers: int = 64,
    ) -> None:
        self.keys, self.limits, self.calls, self.futures = keys, limits, calls, futures
        self.say = say  # the service's log
        self.root = run_dir / "api"
        self.session_timeout = session_timeout
        self.lock = threading.Lock()
        self.sessions: dict[str, tuple[str, float]] = {}  # id -> (owner, last heard from)
        self.clients: dict[str, Client] = {}
        # The clients' numbers not taken (a heap: the lowest is given first).
        self._free_numbers = list(range(limits.max_clients))
        self.samplers: dict[str, Sampler] = {}
        self.seen: dict[tuple[str, int], str] = {}  # (client, seq_id) -> request id
        self.checkpoints = CheckpointIndex(self.root, max_saves)  # a key's at most
        self.expired_at = 0.0  # when sweep last expired checkpoints
        self.max_sessions, self.max_samplers = max_sessions, max_samplers  # per key
        self.memory: dict = {}  # what the service keeps (api/memory.py), for /healthz

    # -- plumbing -------------------------------------------------------------------------

    def answer(self, request_id: str, result: Result) -> None:
        """The engine's answer to a call (from its thread): a save's checkpoint listed once
        written, the call's future done; a call that failed as it ran is logged (whose, why)."""
        if result.kind == ERROR:
            owner = self.futures.owner(request_id)
            self.say(f"api: call {request_id} of {owner} failed: {result.payload[0]}")
            message, category = result.payload
            result = Result(ERROR, (without_server_paths(message), category))
        self.checkpoints.settle(request_id, written=result.kind != ERROR)
        self.futures.complete(request_id, result)

    async def parse_body(self, request: Request, model: type | None = None) -> Any:
        """The body as ``model`` (a JSON object if none), within the sizes a service keeps:
        a body of at most ``MAX_BODY`` bytes, ``user_metadata`` of at most ``MAX_METADATA``."""
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise Refused(413, f"a {len(raw)}-byte body: JSON bodies of up to {MAX_BODY} bytes")
        try:
            body = json.loads(raw or b"{}")
        except ValueError as err:
            raise Refused(400, f"the body is not JSON: {err}") from None
        if model is None:
            if not isinstance(body, dict):
                raise Refused(400, "the body is not a JSON object")
            return body
        parsed = model.model_validate(body)
        kept = json.dumps(getattr(parsed, "user_metadata", None) or {}) + str(
            getattr(parsed, "tags", "")
        )
        if len(kept) > MAX_METADATA:
            raise Refused(
                400,
                f"user_metadata and tags of {len(kept)} bytes: the service keeps up to "
                f"{MAX_METADATA} per client",
            )
        return parsed

    def submit(
        self,
        owner: str,
        kind: str,
        args: dict,
        client: Client | None = None,
        seq_id: int | None = None,
        creates: Client | None = None,
        **answer: Any,
    ) -> dict:
        """Queue a call; its future (a resent call gets its first one's). ``creates``: the
        new client whose creation this is, which a refused call leaves holding nothing. A
        ``skip`` (a refused call's place in its client's order) is refused only out of
        order."""
        model_id = client.model_id if client is not None and seq_id is not None else None
        with self.lock:
            first = self.seen.get((model_id, seq_id))
            if first is not None:
                return {"request_id": first, **answer}
            problem = self.calls.refusal(owner, model_id, seq_id, skip=kind == SKIP)
            if problem is not None:
                if creates is not None:  # its number is free again (nothing reached the engine)
                    heapq.heappush(self._free_numbers, self.clients.pop(creates.model_id).slot)
                    self.calls.forget(creates.model_id)
                raise Refused(*problem)
            request_id = self.futures.new(owner)
            self.calls.put(Op(kind, request_id, args), model_id, seq_id, force=True, owner=owner)
            if creates is not None:
                creates.creation = request_id
            if model_id is not None:
                self.seen[model_id, seq_id] = request_id  # resends come soon: older go
                self.seen.pop((model_id, seq_id - RESEND_WINDOW), None)
        return {"request_id": request_id, **answer}

    def in_order(
        self,
        owner: str,
        client: Client,
        seq_id: int | None,
        build: Callable[[], tuple[str, dict]],
        **answer: Any,
    ) -> dict:
        """Queue the client's call ``build()`` makes (a resent call: its first one's
        future); a refused one still takes its place in the client's order (as a call that
        does nothing), so its later calls run."""
        with self.lock:
            first = self.seen.get((client.model_id, seq_id)) if seq_id is not None else None
        if first is not None:
            return {"request_id": first, **answer}
        try:
            kind, args = build()
        except Refused:
            if seq_id is not None:
                try:
                    self.submit(owner, SKIP, {}, client, seq_id)
                except Refused:
                    pass  # out of its order: it holds no place
            raise
        return self.submit(owner, kind, args, client, seq_id, **answer)

    def client(self, owner: str, model_id: str) -> Client:
        client = self.clients.get(model_id)
        if client is None or client.owner != owner:
            raise Refused(404, f"no training client {model_id!r} of this API key")
        return client

    # -- session --------------------------------------------------------------------------

    async def client_config(self, request: Request, owner: None) -> dict:
        return CLIENT_CONFIG

    async def dynamic_config(self, request: Request, owner: None) -> dict:
        return types.ClientDynamicConfigResponse().model_dump()

    async def healthz(self, request: Request, owner: None) -> dict:
        """Alive, and what the service keeps in all (no tenant's own: this answers anyone)."""
        memory = self.memory
        return {"status": "ok", **({"memory": memory["in_all"]} if memory else {})}

    async def telemetry(self, request: Request, owner: None) -> dict:  # not kept
        return {"status": "accepted"}

    async def not_served(self, request: Request, owner: None) -> Response:
        return refusal(
            404,
            f"{request.method} {request.url.path} is not served by this "
            "service (a local megatron-multilora trainer: training clients, "
            "sampling, save/load, training run and checkpoint listings; no "
            "accounts, billing, publishing or sessions listings)",
        )

    async def capabilities(self, request: Request, owner: str) -> dict:
        return {
            "supported_models": [
                {
                    "model_name": self.limits.model_name,
                    "max_context_length": self.limits.max_seq_len,
                    "trainable": True,
                    "sampleable": True,
                }
            ]
        }

    async def create_session(self, request: Request, owner: str) -> dict:
        await self.parse_body(request, types.CreateSessionRequest)
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        with self.lock:
            held = sum(1 for o, _ in self.sessions.values() if o == owner)
            if held >= self.max_sessions:
                raise Refused(
                    429,
                    f"this API key holds {held} open sessions, the most it may "
                    "(api.max_sessions): close some (ServiceClient.close) or let silent ones "
                    "time out",
                )
            self.sessions[session_id] = (owner, time.monotonic())
        return {"type": "create_session", "session_id": session_id}

    async def heartbeat(self, request: Request, owner: str) -> Response | dict:
        body = await self.parse_body(request, types.SessionHeartbeatRequest)
        with self.lock:
            known = self.sessions.get(body.session_id)
            if known is None or known[0] != owner:
                return refusal(410, f"session {body.session_id} has ended")  # stops heartbeats
            self.sessions[body.session_id] = (owner, time.monotonic())
        return {"type": "session_heartbeat"}

    async def finish_session(self, request: Request, owner: str) -> dict:
        session_id = request.path_params["session_id"]
        with self.lock:
            if self.sessions.get(session_id, (None,))[0] == owner:
                self._end_sessions({session_id})
        return {}

    def sweep(self) -> None:
        """Free the slots of clients whose session has been silent for longer than the
        timeout (a crashed or disconnected client)."""
        now = time.monotonic()
        if now - self.expired_at > 10.0:  # checkpoints past their ttl_seconds go
            self.expired_at = now
            self.checkpoints.expire()
        with self.lock:
            self._end_sessions(
                {
                    sid
                    for sid, (_, seen) in self.sessions.items()
                    if now - seen > self.session_timeout
                }
            )

    def _end_sessions(self, gone: set[str]) -> None:
        """(Holding the lock.) The sessions' clients end; their slots are freed by the
        engine before any later creation takes them."""
        for session_id in gone:
            owner = self.sessions.pop(session_id)[0]
            samplers = [s for s in self.samplers.values() if s.session_id == session_id]
            folders = [s.folder for s in samplers if s.ephemeral]
            for sampler in samplers:
                del self.samplers[sampler.sampler_id]
            self.checkpoints.forget_ephemeral(set(folders))
            self._release(owner, folders, session_id)
        for client in [c for c in self.clients.values() if c.session_id in gone]:
            del self.clients[client.model_id]
            heapq.heappush(self._free_numbers, client.slot)
            self.seen = {k: v for k, v in self.seen.items() if k[0] != client.model_id}
            self.calls.forget(client.model_id)
            self.calls.put(
                Op(FREE, self.futures.new(client.owner), {"slot": client.slot}), force=True
            )

    def _release(self, owner: str, folders: list, session_id: str | None = None) -> None:
        """(Holding the lock.) The engine frees these sampler weights (after the samples
        queued before) and an ended session's recorded samples."""
        args = {"folders": folders, "session": session_id}
        self.calls.put(Op(RELEASE, self.futures.new(owner), args), force=True)

    def add_sampler(self, sampler: Sampler, freed: list[str]) -> None:
        """A new sampling client; the ephemeral samplers whose weights were ``freed`` go."""
        with self.lock:
            held = sum(1 for s in self.samplers.values() if s.owner == sampler.owner)
            if not sampler.ephemeral and held >= self.max_samplers:
                raise Refused(
                    400,
                    f"this API key holds {held} sampling clients, the most it may "
                    "(api.max_samplers): end a session (its samplers go with it) and create "
                    "it again",
                )
            for gone in [s for s in self.samplers.values() if s.folder in freed]:
                del self.samplers[gone.sampler_id]
            self.samplers[sampler.sampler_id] = sampler
            if freed:
                self._release(sampler.owner, freed)

    # -- training clients -----------------------------------------------------------------

    def new_client(
        self,
        owner: str,
        session_id: str,
        model_seq_id: int,
        rank: int,
        user_metadata: dict | None = None,
    ) -> Client:
        if self.sessions.get(session_id, (None,))[0] != owner:
            raise Refused(404, f"no session {session_id!r} of this API key")
        if not 1 <= rank <= self.limits.max_rank:
            raise Refused(
                400,
                f"LoRA rank {rank}: this service trains ranks 1 to "
                f"{self.limits.max_rank} (lora.max_rank)",
            )
        model_id = f"{session_id}:train:{model_seq_id}"
        with self.lock:
            if model_id in self.clients:
                raise Refused(400, f"training client {model_id} exists")
            if not self._free_numbers:
                raise Refused(
                    429,
                    f"this service holds {self.limits.max_clients} training clients at once "
                    f"({self.limits.clients_bound}) and has that many: end one (or wait for an "
                    "idle one to time out) and create it again",
                )
            number = heapq.heappop(self._free_numbers)
            client = self.clients[model_id] = Client(
                model_id, owner, session_id, number, rank, user_metadata
            )
            self.calls.start(model_id)
        return client

    def created(self, owner: str, session_id: str, model_seq_id: int) -> dict | None:
        """A resent creation's answer (the SDK retries a call it heard nothing of): the
        first one's future; None: not a resend."""
        client = self.clients.get(f"{session_id}:train:{model_seq_id}")
        if client is None or client.owner != owner or not client.creation:
            return None
        return {"request_id": client.creation, "model_id": client.model_id}

    # -- futures --------------------------------------------------------------------------

    async def retrieve_future(self, request: Request, owner: str) -> Response | dict:
        body = await self.parse_body(request, types.FutureRetrieveRequest)
        if self.futures.owner(body.request_id) != owner:
            raise Refused(
                404,
                f"no request {body.request_id!r} of this API key (results are kept "
                f"{KEEP_S / 60:.0f} minutes, within api.kept_results_mb)",
            )
        # Held up to 20 s: the SDK asks again at once after a "try again".
        result = await self.futures.wait(body.request_id, 20.0)
        if result is None:
            return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        if result.kind == PROTOBUF:
            return Response(result.payload, media_type=wire.PROTOBUF)
        if result.kind == ERROR:
            message, category = result.payload
            return {"error": message, "category": category}
        return result.payload

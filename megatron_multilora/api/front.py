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
import json
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
from megatron_multilora.api.checkpoint_index import CheckpointIndex
from megatron_multilora.api.futures import ERROR, KEEP_S, PROTOBUF, Futures
from megatron_multilora.api.ops import Op, OpError, read_state_meta
from megatron_multilora.api.request_checks import (
    CLIENT_CONFIG,
    Limits,
    Refused,
    datum_example,
    refusal,
    sample_args,
)
from megatron_multilora.training.objectives.registry import CLIENT_LOSSES

RESEND_WINDOW = 256  # a client's calls whose resend is recognised: its last ones


@dataclasses.dataclass
class Client:
    model_id: str
    owner: str
    session_id: str
    slot: int
    rank: int
    user_metadata: dict | None = None


@dataclasses.dataclass
class Sampler:
    sampler_id: str
    owner: str
    folder: str | None  # its sampler weights; None: the base model


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
    ) -> None:
        self.keys, self.limits, self.calls, self.futures = keys, limits, calls, futures
        self.root = run_dir / "api"
        self.session_timeout = session_timeout
        self.lock = threading.Lock()
        self.sessions: dict[str, tuple[str, float]] = {}  # id -> (owner, last heard from)
        self.clients: dict[str, Client] = {}
        self.samplers: dict[str, Sampler] = {}
        self.seen: dict[tuple[str, int], str] = {}  # (client, seq_id) -> request id
        self.checkpoints = CheckpointIndex(self.root)

    # -- plumbing -------------------------------------------------------------------------

    async def parse_body(self, request: Request, model: type | None = None) -> Any:
        """The body as ``model`` (a JSON object if none)."""
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError as err:
            raise Refused(400, f"the body is not JSON: {err}") from None
        if model is None:
            if not isinstance(body, dict):
                raise Refused(400, "the body is not a JSON object")
            return body
        return model.model_validate(body)

    def _submit(
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
        new client whose creation this is, which a refused call leaves holding nothing."""
        key = (client.model_id, seq_id) if client is not None and seq_id is not None else None
        with self.lock:
            if key in self.seen:
                return {"request_id": self.seen[key], **answer}
            request_id = self.futures.new(owner)
            op = Op(kind, request_id, args)
            queued = self.calls.put(op, client.model_id, seq_id) if key else self.calls.put(op)
            if not queued:
                if creates is not None:  # its slot is free again (nothing reached the engine)
                    del self.clients[creates.model_id]
                    self.calls.forget(creates.model_id)
                raise Refused(429, "the service has too many calls waiting; retry shortly")
            if key:
                self.seen[key] = request_id  # resends come soon: older entries go
                self.seen.pop((client.model_id, seq_id - RESEND_WINDOW), None)
        return {"request_id": request_id, **answer}

    def _in_order(
        self,
        owner: str,
        client: Client,
        seq_id: int | None,
        build: Callable[[], tuple[str, dict]],
        **answer: Any,
    ) -> dict:
        """Queue the client's call ``build()`` makes; a refused one still takes its place in
        the client's order (as a call that does nothing), so its later calls run."""
        try:
            kind, args = build()
        except Refused:
            if seq_id is not None:
                self._submit(owner, "skip", {}, client, seq_id)
            raise
        return self._submit(owner, kind, args, client, seq_id, **answer)

    def _client(self, owner: str, model_id: str) -> Client:
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
        return {"status": "ok"}

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
            del self.sessions[session_id]
        for client in [c for c in self.clients.values() if c.session_id in gone]:
            del self.clients[client.model_id]
            self.seen = {k: v for k, v in self.seen.items() if k[0] != client.model_id}
            self.calls.forget(client.model_id)
            self.calls.put(
                Op("free", self.futures.new(client.owner), {"slot": client.slot}), force=True
            )

    # -- training clients -----------------------------------------------------------------

    def _new_client(
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
            used = {c.slot for c in self.clients.values()}
            free = [s for s in range(self.limits.slots) if s not in used]
            if not free:
                raise Refused(
                    400,
                    f"all {self.limits.slots} adapter slots (lora.slots) hold "
                    "training clients: end one (or wait for an idle one to time "
                    "out) and create it again",
                )
            client = self.clients[model_id] = Client(
                model_id, owner, session_id, free[0], rank, user_metadata
            )
            self.calls.start(model_id)
        return client

    async def create_model(self, request: Request, owner: str) -> dict:
        body = await self.parse_body(request, types.CreateModelRequest)
        if body.base_model != self.limits.model_name:
            raise Refused(
                400,
                f"base_model {body.base_model!r}: this service trains {self.limits.model_name!r}",
            )
        rank = body.lora_config.rank if body.lora_config else 32
        seed = body.lora_config.seed if body.lora_config else None
        client = self._new_client(
            owner, body.session_id, body.model_seq_id, rank, body.user_metadata
        )
        # A seeded adapter starts as a recipe job named seed-<seed> does.
        init_key = f"seed-{seed}" if seed is not None else client.model_id
        return self._submit(
            owner,
            "create",
            {"slot": client.slot, "rank": rank, "init_key": init_key, "model_id": client.model_id},
            creates=client,
            model_id=client.model_id,
        )

    async def get_info(self, request: Request, owner: str) -> dict:
        body = await self.parse_body(request, types.GetInfoRequest)
        client = self._client(owner, body.model_id)
        return {
            "type": "get_info",
            "model_id": client.model_id,
            "is_lora": True,
            "lora_rank": client.rank,
            "model_name": self.limits.model_name,
            "model_data": {
                "arch": "megatron-multilora",
                "model_name": self.limits.model_name,
                "tokenizer_id": self.limits.tokenizer_id,
            },
        }

    async def forward_backward(self, request: Request, owner: str) -> dict:
        call = wire.read_forward_backward(await request.body())
        client = self._client(owner, call.model_id)

        def build() -> tuple[str, dict]:
            if call.loss_fn not in CLIENT_LOSSES:
                raise Refused(
                    400,
                    f"loss_fn {call.loss_fn!r}: this service computes {', '.join(CLIENT_LOSSES)}",
                )
            low = float(call.loss_fn_config.get("clip_low_threshold", 0.8))
            high = float(call.loss_fn_config.get("clip_high_threshold", 1.2))
            data = [
                datum_example(i, d, CLIENT_LOSSES[call.loss_fn], self.limits)
                for i, d in enumerate(call.data)
            ]
            return "forward_backward", {
                "slot": client.slot,
                "loss": call.loss_fn,
                "forward_only": call.forward_only,
                "clip_low": 1.0 - low,
                "clip_high": high - 1.0,
                "data": data,
            }

        return self._in_order(owner, client, call.seq_id, build, model_id=client.model_id)

    async def optim_step(self, request: Request, owner: str) -> dict:
        body = await self.parse_body(request, types.OptimStepRequest)
        client = self._client(owner, body.model_id)

        def build() -> tuple[str, dict]:
            adam = body.optim_params
            if not isinstance(adam, types.AdamParams):
                raise Refused(400, "optim_step: only Adam parameters (AdamParams) are served")
            if not (
                adam.learning_rate >= 0
                and 0 <= adam.beta1 < 1
                and 0 <= adam.beta2 < 1
                and adam.eps > 0
                and adam.weight_decay >= 0
                and adam.grad_clip_norm >= 0
            ):
                raise Refused(400, f"optim_step: AdamParams out of range: {adam.model_dump()}")
            return "optim_step", {
                "slot": client.slot,
                "lr": adam.learning_rate,
                "betas": (adam.beta1, adam.beta2),
                "eps": adam.eps,
                "weight_decay": adam.weight_decay,
                "grad_clip": adam.grad_clip_norm or None,
            }

        return self._in_order(owner, client, body.seq_id, build, model_id=client.model_id)

    async def save_weights(self, request: Request, owner: str) -> dict:
        body = await self.parse_body(request, types.SaveWeightsRequest)
        client = self._client(owner, body.model_id)
        where: list = []

        def build() -> tuple[str, dict]:
            path, folder = self.checkpoints.place(
                owner, client.model_id, "weights", body.path or f"seq-{body.seq_id}"
            )
            if path in self.checkpoints and not body.overwrite:
                raise Refused(400, f"{path} exists; save under another name (or overwrite=True)")
            where.extend((path, folder))
            return "save_state", {
                "slot": client.slot,
                "folder": folder,
                "path": path,
                "meta": {"model_id": client.model_id, "model_name": self.limits.model_name},
            }

        answer = self._in_order(owner, client, body.seq_id, build, model_id=client.model_id)
        self.checkpoints.add(
            where[0], owner, "weights", where[1], client.rank, client.user_metadata
        )
        return answer

    async def load_weights(self, request: Request, owner: str) -> dict:
        body = await self.parse_body(request, types.LoadWeightsRequest)
        if body.model_id is not None:  # into an existing client, in its order
            client = self._client(owner, body.model_id)

            def build() -> tuple[str, dict]:
                entry = self.checkpoints.get(owner, body.path, "weights")
                return "load_state", {
                    "folder": entry["folder"],
                    "optimizer": body.optimizer,
                    "path": body.path,
                    "slot": client.slot,
                    "model_id": client.model_id,
                }

            return self._in_order(owner, client, body.seq_id, build, model_id=client.model_id)
        if body.session_id is None or body.model_seq_id is None:
            raise Refused(400, "load_weights: give model_id, or session_id and model_seq_id")
        entry = self.checkpoints.get(owner, body.path, "weights")
        args = {"folder": entry["folder"], "optimizer": body.optimizer, "path": body.path}
        try:
            rank = read_state_meta(Path(entry["folder"]))["rank"]
        except OpError as err:
            raise Refused(400, str(err)) from None
        client = self._new_client(
            owner, body.session_id, body.model_seq_id, rank, body.user_metadata
        )
        return self._submit(
            owner,
            "load_state",
            {**args, "slot": client.slot, "model_id": client.model_id, "init_key": client.model_id},
            creates=client,
            model_id=client.model_id,
        )

    async def save_weights_for_sampler(self, request: Request, owner: str) -> dict:
        body = await self.parse_body(request, types.SaveWeightsForSamplerRequest)
        client = self._client(owner, body.model_id)
        where: list = []

        def build() -> tuple[str, dict]:
            if body.path is not None:
                path, folder = self.checkpoints.place(
                    owner, client.model_id, "sampler_weights", body.path
                )
                answer, sampler_id = {"type": "save_weights_for_sampler", "path": path}, None
            else:  # save_weights_and_get_sampling_client: a sampler of these weights
                sampler_id = f"{client.session_id}:sample:{body.sampling_session_seq_id}"
                path, folder = self.checkpoints.place(
                    owner,
                    client.model_id,
                    "sampler_weights",
                    f"sampler-{body.sampling_session_seq_id}",
                )
                answer = {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}
            where.extend((path, folder, sampler_id))
            return "save_for_sampler", {
                "slot": client.slot,
                "folder": folder,
                "answer": answer,
                "meta": {"name": client.model_id, "model_name": self.limits.model_name},
            }

        future = self._in_order(owner, client, body.seq_id, build, model_id=client.model_id)
        path, folder, sampler_id = where
        self.checkpoints.add(
            path, owner, "sampler_weights", folder, client.rank, client.user_metadata
        )
        if sampler_id is not None:
            self.samplers[sampler_id] = Sampler(sampler_id, owner, folder)
        return future

    # -- sampling -------------------------------------------------------------------------

    async def create_sampling_session(self, request: Request, owner: str) -> dict:
        body = await self.parse_body(request, types.CreateSamplingSessionRequest)
        if self.sessions.get(body.session_id, (None,))[0] != owner:
            raise Refused(404, f"no session {body.session_id!r} of this API key")
        if body.model_path is not None:
            folder = self.checkpoints.get(owner, body.model_path, "sampler_weights")["folder"]
        elif body.base_model == self.limits.model_name:
            folder = None
        else:
            raise Refused(
                400,
                f"create_sampling_session: give model_path (a sampler_weights "
                f"checkpoint) or base_model={self.limits.model_name!r}",
            )
        sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
        self.samplers[sampler_id] = Sampler(sampler_id, owner, folder)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    async def get_sampler(self, request: Request, owner: str) -> dict:
        sampler = self._sampler(owner, request.path_params["sampler_id"])
        return {
            "sampler_id": sampler.sampler_id,
            "base_model": self.limits.model_name,
            "model_path": None,
        }

    def _sampler(self, owner: str, sampler_id: str | None) -> Sampler:
        sampler = self.samplers.get(sampler_id or "")
        if sampler is None or sampler.owner != owner:
            raise Refused(404, f"no sampler {sampler_id!r} of this API key")
        return sampler

    async def asample(self, request: Request, owner: str) -> dict:
        body = await self.parse_body(request, types.SampleRequest)
        sampler = self._sampler(owner, body.sampling_session_id)
        args = sample_args(body, sampler.sampler_id, self.limits)
        future = self._submit(owner, "sample", {"folder": sampler.folder, **args})
        # The SDK stamps each sample with one of these ids.
        return {
            **future,
            "sample_sequence_ids": [f"{future['request_id']}:{k}" for k in range(body.num_samples)],
        }

    # -- futures --------------------------------------------------------------------------

    async def retrieve_future(self, request: Request, owner: str) -> Response | dict:
        body = await self.parse_body(request, types.FutureRetrieveRequest)
        if self.futures.owner(body.request_id) != owner:
            raise Refused(
                404,
                f"no request {body.request_id!r} of this API key (results are "
                f"kept {KEEP_S / 60:.0f} minutes)",
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

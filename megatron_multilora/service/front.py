"""The HTTP front the ``tinker`` SDK talks to: what each endpoint checks (the caller's key,
that what it names is its own, the request against the run's limits) before a call goes to
the engine's inbox, and the answers.

Bad requests are answered 4xx with the reason before anything changes; a call that fails
while running answers its future with ``{"error", "category"}`` (the SDK raises
``RequestFailedError``). Training clients are ``<session>:train:<n>``, samplers
``<session>:sample:<n>``, checkpoints ``tinker://<client>/<weights|sampler_weights>/<name>``
(folders under ``<run_dir>/api/<tenant>/``; the index of them survives a restart).
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import numpy as np
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tinker import types

from megatron_multilora.atomic_files import write_json_atomic
from megatron_multilora.service import wire
from megatron_multilora.service.engine import Op
from megatron_multilora.service.futures import ERROR, PROTOBUF, Futures
from megatron_multilora.service.inbox import Inbox
from megatron_multilora.training.objectives.per_token import INPUTS

CHECKPOINT_INDEX = "checkpoints.json"


class Refused(Exception):
    """A request answered with ``status`` and ``message`` (nothing was changed)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the run serves: its base model's name, vocabulary and longest sequence, its
    adapter slots and their largest rank; ``tokenizer_id`` (a local folder) for the SDK's
    ``get_tokenizer``."""

    model_name: str
    vocab_size: int
    max_seq_len: int
    slots: int
    max_rank: int
    tokenizer_id: Optional[str]


@dataclasses.dataclass
class Client:
    model_id: str
    owner: str
    session_id: str
    slot: int
    rank: int


@dataclasses.dataclass
class Sampler:
    sampler_id: str
    owner: str
    folder: Optional[str]  # its sampler weights; None: the base model


class Front:
    """The endpoints; ``inbox`` takes the calls for the engine, ``futures`` their results."""

    def __init__(self, keys: dict[str, str], limits: Limits, run_dir: Path, inbox: Inbox,
                 futures: Futures, session_timeout: float) -> None:
        self.keys, self.limits, self.inbox, self.futures = keys, limits, inbox, futures
        self.root = run_dir / "api"
        self.session_timeout = session_timeout
        self.lock = threading.Lock()
        self.sessions: dict[str, tuple[str, float]] = {}  # id -> (owner, last heard from)
        self.clients: dict[str, Client] = {}
        self.samplers: dict[str, Sampler] = {}
        self.seen: dict[tuple[str, int], str] = {}  # (client, seq_id) -> request id
        index = self.root / CHECKPOINT_INDEX
        self.checkpoints: dict[str, dict] = json.loads(index.read_text()) if index.is_file() else {}

    # -- plumbing -------------------------------------------------------------------------

    def app(self) -> Starlette:
        post = {
            "client/config": self.client_config, "client/dynamic_config": self.dynamic_config,
            "create_session": self.create_session, "session_heartbeat": self.heartbeat,
            "sessions/{session_id}/finish": self.finish_session, "telemetry": self.telemetry,
            "create_model": self.create_model, "get_info": self.get_info,
            "forward_backward": self.forward_backward, "optim_step": self.optim_step,
            "save_weights": self.save_weights, "load_weights": self.load_weights,
            "save_weights_for_sampler": self.save_weights_for_sampler,
            "create_sampling_session": self.create_sampling_session, "asample": self.asample,
            "retrieve_future": self.retrieve_future}
        get = {"healthz": self.healthz, "get_server_capabilities": self.capabilities,
               "samplers/{sampler_id}": self.get_sampler}
        routes = [Route(f"/api/v1/{path}", self._endpoint(handler), methods=["POST"])
                  for path, handler in post.items()]
        routes += [Route(f"/api/v1/{path}", self._endpoint(handler), methods=["GET"])
                   for path, handler in get.items()]
        routes.append(Route("/{path:path}", self._endpoint(self.not_served),
                            methods=["GET", "POST", "PUT", "DELETE"]))
        return Starlette(routes=routes)

    def _endpoint(self, handler: Callable[..., Awaitable[Any]]):
        open_paths = {"client_config", "dynamic_config", "healthz", "telemetry", "not_served"}

        async def endpoint(request: Request) -> Response:
            try:
                owner = None
                if handler.__name__ not in open_paths:
                    owner = self.keys.get(request.headers.get("x-api-key", ""))
                    if owner is None:
                        raise Refused(401, "unknown API key (X-API-Key): use one of the keys "
                                           "the service was started with")
                answer = await handler(request, owner)
            except Refused as refused:
                return _refusal(refused.status, str(refused))
            except ValidationError as err:
                return _refusal(400, f"malformed request: {err}")
            except wire.WireError as err:
                return _refusal(400, str(err))
            return answer if isinstance(answer, Response) else JSONResponse(answer)

        endpoint.__name__ = handler.__name__
        return endpoint

    async def _json(self, request: Request, model: type) -> Any:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError as err:
            raise Refused(400, f"the body is not JSON: {err}") from None
        return model.model_validate(body)

    def _submit(self, owner: str, kind: str, args: dict, client: Optional[Client] = None,
                seq_id: Optional[int] = None, **answer: Any) -> dict:
        """Queue a call; its future (a resent call gets its first one's)."""
        key = (client.model_id, seq_id) if client is not None and seq_id is not None else None
        with self.lock:
            if key in self.seen:
                return {"request_id": self.seen[key], **answer}
            request_id = self.futures.new(owner)
            op = Op(kind, request_id, args)
            queued = (self.inbox.put(op, client.model_id, seq_id) if key
                      else self.inbox.put(op))
            if not queued:
                raise Refused(429, "the service has too many calls waiting; retry shortly")
            if key:
                self.seen[key] = request_id
        return {"request_id": request_id, **answer}

    def _client(self, owner: str, model_id: str) -> Client:
        client = self.clients.get(model_id)
        if client is None or client.owner != owner:
            raise Refused(404, f"no training client {model_id!r} of this API key")
        return client

    def _checkpoint(self, owner: str, path: str, kind: str) -> dict:
        entry = self.checkpoints.get(path)
        if entry is None or entry["owner"] != owner:
            raise Refused(404, f"no checkpoint {path!r} of this API key")
        if entry["kind"] != kind:
            raise Refused(400, f"{path} holds {entry['kind']}, not {kind}")
        return entry

    def _folder(self, owner: str, model_id: str, kind: str, name: str) -> tuple[str, str]:
        if not name or "/" in name or name.startswith("."):
            raise Refused(400, f"checkpoint name {name!r}: use letters, digits, '-', '_', '.' "
                               "(no '/')")
        path = f"tinker://{model_id}/{kind}/{name}"
        return path, str(self.root / owner / model_id.replace(":", "_") / kind / name)

    def _remember(self, path: str, entry: dict) -> None:
        with self.lock:
            self.checkpoints[path] = entry
            self.root.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.root / CHECKPOINT_INDEX, self.checkpoints)

    # -- session --------------------------------------------------------------------------

    async def client_config(self, request: Request, owner: None) -> dict:
        # The SDK's simplest paths: plain API keys, uncompressed bodies sent one by one,
        # a future polled per call.
        return types.ClientConfigResponse(
            pjwt_auth_enabled=False, proto_compress_fwdbwd=False, parallel_fwdbwd_chunks=False,
            use_pyqwest_transport=False, sample_use_retrieve_futures=False,
            custom_loss_server_side=False, sample_join_sampling_session=False).model_dump()

    async def dynamic_config(self, request: Request, owner: None) -> dict:
        return types.ClientDynamicConfigResponse().model_dump()

    async def healthz(self, request: Request, owner: None) -> dict:
        return {"status": "ok"}

    async def telemetry(self, request: Request, owner: None) -> dict:
        return {"status": "accepted"}

    async def not_served(self, request: Request, owner: None) -> Response:
        return _refusal(404, f"{request.method} {request.url.path} is not served by this "
                             "service (a local megatron-multilora trainer: training clients, "
                             "sampling, save/load; no accounts, billing or REST listings)")

    async def capabilities(self, request: Request, owner: str) -> dict:
        return {"supported_models": [{"model_name": self.limits.model_name,
                                      "max_context_length": self.limits.max_seq_len,
                                      "trainable": True, "sampleable": True}]}

    async def create_session(self, request: Request, owner: str) -> dict:
        await self._json(request, types.CreateSessionRequest)
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        with self.lock:
            self.sessions[session_id] = (owner, time.monotonic())
        return {"type": "create_session", "session_id": session_id}

    async def heartbeat(self, request: Request, owner: str) -> Response | dict:
        body = await self._json(request, types.SessionHeartbeatRequest)
        with self.lock:
            known = self.sessions.get(body.session_id)
            if known is None or known[0] != owner:
                return _refusal(410, f"session {body.session_id} has ended")  # stops heartbeats
            self.sessions[body.session_id] = (owner, time.monotonic())
        return {"type": "session_heartbeat"}

    async def finish_session(self, request: Request, owner: str) -> dict:
        session_id = request.path_params["session_id"]
        with self.lock:
            if self.sessions.get(session_id, (None,))[0] == owner:
                self.sessions[session_id] = (owner, -math.inf)  # freed at the next sweep
        return {}

    def sweep(self) -> list[Op]:
        """Free the slots of clients whose session ended or has been silent for longer than
        the timeout (a crashed or disconnected client); the engine runs the calls returned."""
        now, ops = time.monotonic(), []
        with self.lock:
            gone = {sid for sid, (_, seen) in self.sessions.items()
                    if now - seen > self.session_timeout}
            for session_id in gone:
                del self.sessions[session_id]
            for client in [c for c in self.clients.values() if c.session_id in gone]:
                del self.clients[client.model_id]
                self.inbox.forget(client.model_id)
                ops.append(Op("free", self.futures.new(client.owner), {"slot": client.slot}))
        return ops

    # -- training clients -----------------------------------------------------------------

    def _new_client(self, owner: str, session_id: str, model_seq_id: int, rank: int) -> Client:
        if self.sessions.get(session_id, (None,))[0] != owner:
            raise Refused(404, f"no session {session_id!r} of this API key")
        if not 1 <= rank <= self.limits.max_rank:
            raise Refused(400, f"LoRA rank {rank}: this service trains ranks 1 to "
                               f"{self.limits.max_rank} (lora.max_rank)")
        model_id = f"{session_id}:train:{model_seq_id}"
        with self.lock:
            if model_id in self.clients:
                raise Refused(400, f"training client {model_id} exists")
            used = {c.slot for c in self.clients.values()}
            free = [s for s in range(self.limits.slots) if s not in used]
            if not free:
                raise Refused(400, f"all {self.limits.slots} adapter slots (lora.slots) hold "
                                   "training clients: end one (or wait for an idle one to time "
                                   "out) and create it again")
            client = self.clients[model_id] = Client(model_id, owner, session_id, free[0], rank)
            self.inbox.start(model_id)
        return client

    async def create_model(self, request: Request, owner: str) -> dict:
        body = await self._json(request, types.CreateModelRequest)
        if body.base_model != self.limits.model_name:
            raise Refused(400, f"base_model {body.base_model!r}: this service trains "
                               f"{self.limits.model_name!r}")
        rank = body.lora_config.rank if body.lora_config else 32
        seed = body.lora_config.seed if body.lora_config else None
        client = self._new_client(owner, body.session_id, body.model_seq_id, rank)
        # A seeded adapter starts as a recipe job named seed-<seed> does.
        init_key = f"seed-{seed}" if seed is not None else client.model_id
        return self._submit(owner, "create", {"slot": client.slot, "rank": rank,
                                              "init_key": init_key, "model_id": client.model_id},
                            model_id=client.model_id)

    async def get_info(self, request: Request, owner: str) -> dict:
        body = await self._json(request, types.GetInfoRequest)
        client = self._client(owner, body.model_id)
        return {"type": "get_info", "model_id": client.model_id, "is_lora": True,
                "lora_rank": client.rank, "model_name": self.limits.model_name,
                "model_data": {"arch": "megatron-multilora", "model_name": self.limits.model_name,
                               "tokenizer_id": self.limits.tokenizer_id}}

    async def forward_backward(self, request: Request, owner: str) -> dict:
        call = wire.read_forward_backward(await request.body())
        client = self._client(owner, call.model_id)
        if call.loss_fn not in INPUTS:
            raise Refused(400, f"loss_fn {call.loss_fn!r}: this service computes "
                               f"{', '.join(INPUTS)}")
        low = float(call.loss_fn_config.get("clip_low_threshold", 0.8))
        high = float(call.loss_fn_config.get("clip_high_threshold", 1.2))
        data = [self._datum(i, d, INPUTS[call.loss_fn]) for i, d in enumerate(call.data)]
        return self._submit(owner, "forward_backward", {
            "slot": client.slot, "loss": call.loss_fn, "forward_only": call.forward_only,
            "clip_low": 1.0 - low, "clip_high": high - 1.0, "data": data},
            client, call.seq_id, model_id=client.model_id)

    def _datum(self, i: int, datum: wire.Datum, needed: tuple[str, ...]) -> dict:
        """A datum as an example: its tokens and the loss's per-position inputs."""
        tokens, n = datum.tokens, len(datum.tokens)
        where = f"datum {i}"
        self._check_tokens(tokens, where)
        if n + 1 > self.limits.max_seq_len:
            raise Refused(400, f"{where}: {n} tokens; at most {self.limits.max_seq_len - 1} "
                               "(trainer.max_seq_len, with its last target)")
        targets = datum.inputs.get("target_tokens")
        if targets is None or targets.shape != (n,):
            raise Refused(400, f"{where}: loss_fn_inputs.target_tokens must have one target per "
                               f"input token ({n})")
        if n > 1 and not np.array_equal(targets[:-1], np.asarray(tokens[1:])):
            raise Refused(400, f"{where}: target_tokens must be model_input shifted by one (each "
                               "position's next token); other targets are not served")
        self._check_tokens(targets[-1:].tolist(), f"{where} target_tokens")
        values = {}
        for name in needed:
            value = datum.inputs.get(name)
            if value is None or value.shape != (n,):
                raise Refused(400, f"{where}: loss_fn_inputs.{name} must have one value per "
                                   f"input token ({n})")
            if not np.isfinite(value).all():
                raise Refused(400, f"{where}: loss_fn_inputs.{name} has non-finite values")
            values[name] = tuple(float(v) for v in value)
        return {"tokens": list(tokens) + [int(targets[-1])], "values": values}

    def _check_tokens(self, tokens: list[int], where: str) -> None:
        if not tokens:
            raise Refused(400, f"{where}: no tokens")
        bad = [t for t in tokens if not 0 <= t < self.limits.vocab_size]
        if bad:
            raise Refused(400, f"{where}: token id {bad[0]} is outside the vocabulary "
                               f"(0 to {self.limits.vocab_size - 1})")

    async def optim_step(self, request: Request, owner: str) -> dict:
        body = await self._json(request, types.OptimStepRequest)
        client = self._client(owner, body.model_id)
        adam = body.optim_params
        if not isinstance(adam, types.AdamParams):
            raise Refused(400, "optim_step: only Adam parameters (AdamParams) are served")
        if not (adam.learning_rate >= 0 and 0 <= adam.beta1 < 1 and 0 <= adam.beta2 < 1
                and adam.eps > 0 and adam.weight_decay >= 0 and adam.grad_clip_norm >= 0):
            raise Refused(400, f"optim_step: AdamParams out of range: {adam.model_dump()}")
        return self._submit(owner, "optim_step", {
            "slot": client.slot, "lr": adam.learning_rate, "betas": (adam.beta1, adam.beta2),
            "eps": adam.eps, "weight_decay": adam.weight_decay,
            "grad_clip": adam.grad_clip_norm or None}, client, body.seq_id,
            model_id=client.model_id)

    async def save_weights(self, request: Request, owner: str) -> dict:
        body = await self._json(request, types.SaveWeightsRequest)
        client = self._client(owner, body.model_id)
        path, folder = self._folder(owner, client.model_id, "weights",
                                    body.path or f"seq-{body.seq_id}")
        if path in self.checkpoints and not body.overwrite:
            raise Refused(400, f"{path} exists; save under another name (or overwrite=True)")
        answer = self._submit(owner, "save_state", {
            "slot": client.slot, "folder": folder, "path": path,
            "meta": {"model_id": client.model_id, "model_name": self.limits.model_name}},
            client, body.seq_id, model_id=client.model_id)
        self._remember(path, {"owner": owner, "kind": "weights", "folder": folder})
        return answer

    async def load_weights(self, request: Request, owner: str) -> dict:
        body = await self._json(request, types.LoadWeightsRequest)
        entry = self._checkpoint(owner, body.path, "weights")
        args = {"folder": entry["folder"], "optimizer": body.optimizer, "path": body.path}
        if body.model_id is not None:  # into an existing client, in its order
            client = self._client(owner, body.model_id)
            return self._submit(owner, "load_state", {**args, "slot": client.slot,
                                                      "model_id": client.model_id},
                                client, body.seq_id, model_id=client.model_id)
        if body.session_id is None or body.model_seq_id is None:
            raise Refused(400, "load_weights: give model_id, or session_id and model_seq_id")
        rank = json.loads((Path(entry["folder"]) / "meta.json").read_text())["rank"]
        client = self._new_client(owner, body.session_id, body.model_seq_id, rank)
        return self._submit(owner, "load_state", {**args, "slot": client.slot,
                                                  "model_id": client.model_id,
                                                  "init_key": client.model_id},
                            model_id=client.model_id)

    async def save_weights_for_sampler(self, request: Request, owner: str) -> dict:
        body = await self._json(request, types.SaveWeightsForSamplerRequest)
        client = self._client(owner, body.model_id)
        if body.path is not None:
            path, folder = self._folder(owner, client.model_id, "sampler_weights", body.path)
            answer, sampler_id = {"type": "save_weights_for_sampler", "path": path}, None
        else:  # save_weights_and_get_sampling_client: a sampler of these weights
            sampler_id = f"{client.session_id}:sample:{body.sampling_session_seq_id}"
            path, folder = self._folder(owner, client.model_id, "sampler_weights",
                                        f"sampler-{body.sampling_session_seq_id}")
            answer = {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}
        future = self._submit(owner, "save_for_sampler", {
            "slot": client.slot, "folder": folder, "answer": answer,
            "meta": {"name": client.model_id, "model_name": self.limits.model_name}},
            client, body.seq_id, model_id=client.model_id)
        self._remember(path, {"owner": owner, "kind": "sampler_weights", "folder": folder})
        if sampler_id is not None:
            self.samplers[sampler_id] = Sampler(sampler_id, owner, folder)
        return future

    # -- sampling -------------------------------------------------------------------------

    async def create_sampling_session(self, request: Request, owner: str) -> dict:
        body = await self._json(request, types.CreateSamplingSessionRequest)
        if self.sessions.get(body.session_id, (None,))[0] != owner:
            raise Refused(404, f"no session {body.session_id!r} of this API key")
        if body.model_path is not None:
            folder = self._checkpoint(owner, body.model_path, "sampler_weights")["folder"]
        elif body.base_model == self.limits.model_name:
            folder = None
        else:
            raise Refused(400, f"create_sampling_session: give model_path (a sampler_weights "
                               f"checkpoint) or base_model={self.limits.model_name!r}")
        sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
        self.samplers[sampler_id] = Sampler(sampler_id, owner, folder)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    async def get_sampler(self, request: Request, owner: str) -> dict:
        sampler = self._sampler(owner, request.path_params["sampler_id"])
        return {"sampler_id": sampler.sampler_id, "base_model": self.limits.model_name,
                "model_path": None}

    def _sampler(self, owner: str, sampler_id: Optional[str]) -> Sampler:
        sampler = self.samplers.get(sampler_id or "")
        if sampler is None or sampler.owner != owner:
            raise Refused(404, f"no sampler {sampler_id!r} of this API key")
        return sampler

    async def asample(self, request: Request, owner: str) -> dict:
        body = await self._json(request, types.SampleRequest)
        sampler = self._sampler(owner, body.sampling_session_id)
        params = body.sampling_params
        prompt = body.prompt.to_ints()
        self._check_tokens(prompt, "prompt")
        max_tokens = params.max_tokens or 16
        if len(prompt) + max_tokens > self.limits.max_seq_len:
            raise Refused(400, f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) is "
                               f"over trainer.max_seq_len={self.limits.max_seq_len}")
        if params.top_k not in (-1, 0, None):
            raise Refused(400, "sampling_params.top_k: not served (use top_p)")
        stop = params.stop or []
        if isinstance(stop, str) or not all(isinstance(s, int) for s in stop):
            raise Refused(400, "sampling_params.stop: only stop token ids are served (a list "
                               "of ints), not strings")
        if not 1 <= body.num_samples <= 256:
            raise Refused(400, f"num_samples={body.num_samples}: 1 to 256")
        if not (params.temperature > 0 and 0 < params.top_p <= 1):
            raise Refused(400, "sampling_params: temperature must be > 0 and top_p in (0, 1]")
        # Draws keyed by the seed (the same seed: the same samples) or by the request.
        key = (f"seed:{params.seed}" if params.seed is not None
               else f"{sampler.sampler_id}:{body.seq_id}:{uuid.uuid4().hex}")
        future = self._submit(owner, "sample", {
            "folder": sampler.folder, "prompt": prompt,
            "num_samples": body.num_samples, "max_tokens": max_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "stop": list(stop),
            "key": key, "prompt_logprobs": bool(body.prompt_logprobs)})
        # The SDK stamps each sample with one of these ids.
        return {**future, "sample_sequence_ids": [f"{future['request_id']}:{k}"
                                                  for k in range(body.num_samples)]}

    # -- futures --------------------------------------------------------------------------

    async def retrieve_future(self, request: Request, owner: str) -> Response | dict:
        body = await self._json(request, types.FutureRetrieveRequest)
        if self.futures.owner(body.request_id) != owner:
            raise Refused(404, f"no request {body.request_id!r} of this API key")
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


def _refusal(status: int, message: str) -> JSONResponse:
    # Always a body (an empty 400 is retried by the SDK as a proxy glitch).
    return JSONResponse({"detail": message}, status_code=status,
                        headers={"x-should-retry": "false"})

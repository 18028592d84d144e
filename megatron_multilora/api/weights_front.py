"""The endpoints that save and load a training client's weights: its state (``save_weights``,
``load_weights``, into it or into a new client) and its sampler weights
(``save_weights_for_sampler``, which ``save_weights_and_get_sampling_client`` makes a
sampler of)."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from tinker import types

from megatron_multilora.api.calls import (
    LOAD_STATE,
    SAVE_FOR_SAMPLER,
    SAVE_STATE,
    OpError,
    read_state_meta,
)
from megatron_multilora.api.front import Front, Sampler
from megatron_multilora.api.request_checks import Refused


class WeightsEndpoints:
    def __init__(self, front: Front) -> None:
        self.front = front  # its clients, samplers, checkpoint index and call queue

    async def save_weights(self, request: Request, owner: str) -> dict:
        body = await self.front.parse_body(request, types.SaveWeightsRequest)
        client = self.front.client(owner, body.model_id)
        where: list = []

        def build() -> tuple[str, dict]:
            _check_ttl(body.ttl_seconds)
            self.front.checkpoints.check_room(owner)
            path, folder = self.front.checkpoints.place(
                owner, client.model_id, "weights", body.path or f"seq-{body.seq_id}"
            )
            if path in self.front.checkpoints and not body.overwrite:
                raise Refused(400, f"{path} exists; save under another name (or overwrite=True)")
            where.extend((path, folder))
            return SAVE_STATE, {
                "slot": client.slot,
                "folder": folder,
                "path": path,
                "meta": {"model_id": client.model_id, "model_name": self.front.limits.model_name},
            }

        answer = self.front.in_order(owner, client, body.seq_id, build, model_id=client.model_id)
        if where:  # not a resent call's
            self.front.checkpoints.add(
                where[0],
                owner,
                "weights",
                where[1],
                (client.rank, client.user_metadata),
                answer["request_id"],
                body.ttl_seconds,
            )
        return answer

    async def load_weights(self, request: Request, owner: str) -> dict:
        body = await self.front.parse_body(request, types.LoadWeightsRequest)
        if body.model_id is not None:  # into an existing client, in its order
            client = self.front.client(owner, body.model_id)

            def build() -> tuple[str, dict]:  # after the client's earlier calls: its saves
                entry = self.front.checkpoints.get(owner, body.path, "weights", pending=True)
                return LOAD_STATE, {
                    "folder": entry["folder"],
                    "optimizer": body.optimizer,
                    "path": body.path,
                    "slot": client.slot,
                    "model_id": client.model_id,
                }

            return self.front.in_order(owner, client, body.seq_id, build, model_id=client.model_id)
        if body.session_id is None or body.model_seq_id is None:
            raise Refused(400, "load_weights: give model_id, or session_id and model_seq_id")
        resent = self.front.created(owner, body.session_id, body.model_seq_id)
        if resent is not None:
            return resent
        entry = self.front.checkpoints.get(owner, body.path, "weights")
        args = {"folder": entry["folder"], "optimizer": body.optimizer, "path": body.path}
        try:
            rank = read_state_meta(Path(entry["folder"]))["rank"]
        except OpError as err:
            raise Refused(400, str(err)) from None
        client = self.front.new_client(
            owner, body.session_id, body.model_seq_id, rank, body.user_metadata
        )
        return self.front.submit(
            owner,
            LOAD_STATE,
            {**args, "slot": client.slot, "model_id": client.model_id, "init_key": client.model_id},
            creates=client,
            model_id=client.model_id,
        )

    async def save_weights_for_sampler(self, request: Request, owner: str) -> dict:
        body = await self.front.parse_body(request, types.SaveWeightsForSamplerRequest)
        client = self.front.client(owner, body.model_id)
        where: list = []

        def build() -> tuple[str, dict]:
            _check_ttl(body.ttl_seconds)
            if body.path is not None:
                self.front.checkpoints.check_room(owner)
                name, sampler_id = body.path, None
            else:  # save_weights_and_get_sampling_client: a sampler of these weights
                name = f"sampler-{body.sampling_session_seq_id}"
                sampler_id = f"{client.session_id}:sample:{body.sampling_session_seq_id}"
            path, folder = self.front.checkpoints.place(
                owner, client.model_id, "sampler_weights", name
            )
            answer = {"type": "save_weights_for_sampler"}
            answer.update(
                {"path": path} if sampler_id is None else {"sampling_session_id": sampler_id}
            )
            where.extend((path, folder, sampler_id))
            return SAVE_FOR_SAMPLER, {
                "slot": client.slot,
                "folder": folder,
                "answer": answer,
                "meta": {"name": client.model_id, "model_name": self.front.limits.model_name},
            }

        future = self.front.in_order(owner, client, body.seq_id, build, model_id=client.model_id)
        if not where:  # a resent call's future
            return future
        path, folder, sampler_id = where
        freed = self.front.checkpoints.add(
            path,
            owner,
            "sampler_weights",
            folder,
            (client.rank, client.user_metadata),
            future["request_id"],
            body.ttl_seconds,
            ephemeral=sampler_id is not None,
        )
        if sampler_id is not None:
            self.front.add_sampler(Sampler(sampler_id, owner, folder, ephemeral=True), freed)
        return future


def _check_ttl(ttl_seconds: int | None) -> None:
    if ttl_seconds is not None and ttl_seconds <= 0:
        raise Refused(400, f"ttl_seconds={ttl_seconds}: give a positive number (None: kept)")

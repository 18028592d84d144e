"""The endpoints of a training client's calls: ``create_model`` (a client in a free
adapter slot), ``get_info``, ``forward_backward`` and ``optim_step`` (run in the client's
order, batched with other clients' by the engine)."""

from __future__ import annotations

from starlette.requests import Request
from tinker import types

from megatron_multilora.api import wire
from megatron_multilora.api.calls import CREATE, FORWARD_BACKWARD, OPTIM_STEP
from megatron_multilora.api.front import Front
from megatron_multilora.api.request_checks import (
    Refused,
    check_optimizer,
    datum_example,
    lora_parts,
    loss_config,
)


class TrainingEndpoints:
    def __init__(self, front: Front) -> None:
        self.front = front  # its sessions, clients and call queue

    async def create_model(self, request: Request, owner: str) -> dict:
        body = await self.front.parse_body(request, types.CreateModelRequest)
        if body.base_model != self.front.limits.model_name:
            raise Refused(
                400,
                f"base_model {body.base_model!r}: this service trains {self.front.limits.model_name!r}",
            )
        resent = self.front.created(owner, body.session_id, body.model_seq_id)
        if resent is not None:
            return resent
        lora = body.lora_config or types.LoraConfig(rank=32)
        parts = lora_parts(lora, self.front.limits)
        check_optimizer(body.optimizer_config)
        client = self.front.new_client(
            owner, body.session_id, body.model_seq_id, lora.rank, body.user_metadata
        )
        # A seeded adapter starts as a recipe job named seed-<seed> does.
        init_key = f"seed-{lora.seed}" if lora.seed is not None else client.model_id
        args = {"slot": client.slot, "rank": lora.rank, "init_key": init_key, "parts": parts}
        return self.front.submit(
            owner,
            CREATE,
            {**args, "model_id": client.model_id},
            creates=client,
            model_id=client.model_id,
        )

    async def get_info(self, request: Request, owner: str) -> dict:
        body = await self.front.parse_body(request, types.GetInfoRequest)
        client = self.front.client(owner, body.model_id)
        return {
            "type": "get_info",
            "model_id": client.model_id,
            "is_lora": True,
            "lora_rank": client.rank,
            "model_name": self.front.limits.model_name,
            "model_data": {
                "arch": "megatron-multilora",
                "model_name": self.front.limits.model_name,
                "tokenizer_id": self.front.limits.tokenizer_id,
            },
        }

    async def forward_backward(self, request: Request, owner: str) -> dict:
        call = wire.read_forward_backward(await request.body())
        client = self.front.client(owner, call.model_id)

        def build() -> tuple[str, dict]:
            config = loss_config(call.loss_fn, call.loss_fn_config)
            return FORWARD_BACKWARD, {
                "slot": client.slot,
                "session": client.session_id,
                "loss": call.loss_fn,
                "config": config,
                "forward_only": call.forward_only,
                "data": [
                    datum_example(i, d, call.loss_fn, self.front.limits)
                    for i, d in enumerate(call.data)
                ],
            }

        return self.front.in_order(owner, client, call.seq_id, build, model_id=client.model_id)

    async def optim_step(self, request: Request, owner: str) -> dict:
        body = await self.front.parse_body(request, types.OptimStepRequest)
        client = self.front.client(owner, body.model_id)

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
            return OPTIM_STEP, {
                "slot": client.slot,
                "lr": adam.learning_rate,
                "betas": (adam.beta1, adam.beta2),
                "eps": adam.eps,
                "weight_decay": adam.weight_decay,
                "grad_clip": adam.grad_clip_norm or None,
            }

        return self.front.in_order(owner, client, body.seq_id, build, model_id=client.model_id)

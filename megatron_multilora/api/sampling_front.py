"""The sampling endpoints: a sampler of the base model or of saved sampler weights, its
info, and ``asample`` (each sample named ``<request id>:<k>``, the ``sequence_id`` the SDK
stamps on it)."""

from __future__ import annotations

from starlette.requests import Request
from tinker import types

from megatron_multilora.api.calls import SAMPLE
from megatron_multilora.api.front import Front, Sampler
from megatron_multilora.api.request_checks import Refused, sample_args


class SamplingEndpoints:
    def __init__(self, front: Front) -> None:
        self.front = front  # its sessions, samplers, checkpoint index and call queue

    async def create_sampling_session(self, request: Request, owner: str) -> dict:
        body = await self.front.parse_body(request, types.CreateSamplingSessionRequest)
        if self.front.sessions.get(body.session_id, (None,))[0] != owner:
            raise Refused(404, f"no session {body.session_id!r} of this API key")
        if body.model_path is not None:
            folder = self.front.checkpoints.get(owner, body.model_path, "sampler_weights")["folder"]
        elif body.base_model == self.front.limits.model_name:
            folder = None
        else:
            raise Refused(
                400,
                f"create_sampling_session: give model_path (a sampler_weights "
                f"checkpoint) or base_model={self.front.limits.model_name!r}",
            )
        sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
        self.front.add_sampler(Sampler(sampler_id, owner, folder), [])
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    async def get_sampler(self, request: Request, owner: str) -> dict:
        sampler = self._sampler(owner, request.path_params["sampler_id"])
        return {
            "sampler_id": sampler.sampler_id,
            "base_model": self.front.limits.model_name,
            "model_path": None,
        }

    def _sampler(self, owner: str, sampler_id: str | None) -> Sampler:
        sampler = self.front.samplers.get(sampler_id or "")
        if sampler is None or sampler.owner != owner:
            raise Refused(
                404,
                f"no sampler {sampler_id!r} of this API key (a sampler goes with its session; "
                "of save_weights_and_get_sampling_client's, a key keeps its last 8)",
            )
        return sampler

    async def asample(self, request: Request, owner: str) -> dict:
        body = await self.front.parse_body(request, types.SampleRequest)
        sampler = self._sampler(owner, body.sampling_session_id)
        args = sample_args(body, sampler.sampler_id, self.front.limits)
        args = {"folder": sampler.folder, "session": sampler.session_id, **args}
        future = self.front.submit(owner, SAMPLE, args)
        # The SDK stamps each sample with one of these ids.
        return {
            **future,
            "sample_sequence_ids": [f"{future['request_id']}:{k}" for k in range(body.num_samples)],
        }

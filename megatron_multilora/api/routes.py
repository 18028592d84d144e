"""The service's HTTP routes (Starlette) onto the front's endpoints."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from megatron_multilora.api import wire
from megatron_multilora.api.front import Front
from megatron_multilora.api.listings import Listings
from megatron_multilora.api.request_checks import Refused, refusal
from megatron_multilora.api.sampling_front import SamplingEndpoints
from megatron_multilora.api.training_front import TrainingEndpoints
from megatron_multilora.api.weights_front import WeightsEndpoints


def build_app(front: Front) -> Starlette:
    """The endpoints' routes: each checks the caller's key (but the open ones) and turns
    a refusal into its 4xx answer."""
    listings, weights, sampling = Listings(front), WeightsEndpoints(front), SamplingEndpoints(front)
    training = TrainingEndpoints(front)
    post = {
        "client/config": front.client_config,
        "client/dynamic_config": front.dynamic_config,
        "create_session": front.create_session,
        "session_heartbeat": front.heartbeat,
        "sessions/{session_id}/finish": front.finish_session,
        "telemetry": front.telemetry,
        "create_model": training.create_model,
        "get_info": training.get_info,
        "forward_backward": training.forward_backward,
        "optim_step": training.optim_step,
        "save_weights": weights.save_weights,
        "load_weights": weights.load_weights,
        "save_weights_for_sampler": weights.save_weights_for_sampler,
        "create_sampling_session": sampling.create_sampling_session,
        "asample": sampling.asample,
        "retrieve_future": front.retrieve_future,
        "weights_info": listings.weights_info,
    }
    get = {
        "healthz": front.healthz,
        "get_server_capabilities": front.capabilities,
        "samplers/{sampler_id}": sampling.get_sampler,
        "training_runs": listings.list_training_runs,
        "training_runs/{model_id}": listings.get_training_run,
        "training_runs/{model_id}/checkpoints": listings.list_checkpoints,
        "checkpoints": listings.list_user_checkpoints,
    }
    delete = {
        "training_runs/{model_id}/checkpoints/{checkpoint_id:path}": listings.delete_checkpoint
    }
    routes = [
        Route(f"/api/v1/{path}", _endpoint(front, handler), methods=[method])
        for method, table in (("POST", post), ("GET", get), ("DELETE", delete))
        for path, handler in table.items()
    ]
    routes.append(
        Route(
            "/{path:path}",
            _endpoint(front, front.not_served),
            methods=["GET", "POST", "PUT", "DELETE"],
        )
    )
    return Starlette(routes=routes)


def _endpoint(front: Front, handler: Callable[..., Awaitable[Any]]):
    open_paths = {"client_config", "dynamic_config", "healthz", "telemetry", "not_served"}

    async def endpoint(request: Request) -> Response:
        try:
            owner = None
            if handler.__name__ not in open_paths:
                owner = front.keys.get(request.headers.get("x-api-key", ""))
                if owner is None:
                    raise Refused(
                        401,
                        "unknown API key (X-API-Key): use one of the keys "
                        "the service was started with",
                    )
            answer = await handler(request, owner)
        except Refused as refused:
            status, message = refused.status, str(refused)
        except ValidationError as err:
            status, message = 400, f"malformed request: {err}"
        except wire.WireError as err:
            status, message = 400, str(err)
        else:
            return answer if isinstance(answer, Response) else JSONResponse(answer)
        # Every refusal is in the service's log: whose, which call, why.
        print(
            f"api: refused {request.method} {request.url.path} of "
            f"{owner or 'an unknown key'}: {status} {message}",
            flush=True,
        )
        return refusal(status, message)

    endpoint.__name__ = handler.__name__
    return endpoint

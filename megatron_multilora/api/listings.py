"""The tinker REST client's listings: a key's training runs (its live training clients and
the clients its checkpoints name, e.g. from before a restart) and checkpoints, their weights'
info, and deleting a checkpoint. Another key's are 404."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

from starlette.requests import Request
from tinker import types

from megatron_multilora.api.front import Front
from megatron_multilora.api.request_checks import Refused


class Listings:
    def __init__(self, front: Front) -> None:
        self.front = front  # its clients, checkpoint index and limits

    def _runs(self, owner: str) -> list[types.TrainingRun]:
        """The owner's training clients: the live ones, then those known by their
        checkpoints only (from before a restart, or ended)."""
        checkpoints = self.front.checkpoints.owned(owner)
        with self.front.lock:
            live = [c for c in self.front.clients.values() if c.owner == owner]
        ids = [c.model_id for c in live]
        ids += sorted(
            {c.tinker_path[len("tinker://") :].split("/")[0] for c in checkpoints} - set(ids)
        )
        runs = []
        for model_id in ids:
            mine = [c for c in checkpoints if c.tinker_path.startswith(f"tinker://{model_id}/")]
            client = next((c for c in live if c.model_id == model_id), None)
            info = (
                dataclasses.asdict(client)
                if client is not None
                else self.front.checkpoints.run_info(model_id)
            )
            last = {
                kind: next((c for c in reversed(mine) if c.checkpoint_type == kind), None)
                for kind in ("training", "sampler")
            }
            runs.append(
                types.TrainingRun(
                    training_run_id=model_id,
                    base_model=self.front.limits.model_name,
                    model_owner=owner,
                    is_lora=True,
                    lora_rank=info["rank"],
                    user_metadata=info["user_metadata"],
                    last_request_time=(
                        datetime.now(UTC) if client is not None or not mine else mine[-1].time
                    ),
                    last_checkpoint=last["training"],
                    last_sampler_checkpoint=last["sampler"],
                )
            )
        return runs

    def _run(self, owner: str, model_id: str) -> types.TrainingRun:
        run = next((r for r in self._runs(owner) if r.training_run_id == model_id), None)
        if run is None:
            raise Refused(404, f"no training run {model_id!r} of this API key")
        return run

    async def list_training_runs(self, request: Request, owner: str) -> dict:
        runs = self._runs(owner)
        page, cursor = _page(request, runs, 20)
        return {"training_runs": [r.model_dump(mode="json") for r in page], "cursor": cursor}

    async def get_training_run(self, request: Request, owner: str) -> dict:
        return self._run(owner, request.path_params["model_id"]).model_dump(mode="json")

    async def list_checkpoints(self, request: Request, owner: str) -> dict:
        model_id = self._run(owner, request.path_params["model_id"]).training_run_id
        return {
            "checkpoints": [
                c.model_dump(mode="json") for c in self.front.checkpoints.owned(owner, model_id)
            ]
        }

    async def list_user_checkpoints(self, request: Request, owner: str) -> dict:
        page, cursor = _page(request, self.front.checkpoints.owned(owner), 100)
        return {"checkpoints": [c.model_dump(mode="json") for c in page], "cursor": cursor}

    async def delete_checkpoint(self, request: Request, owner: str) -> dict:
        params = request.path_params
        path = f"tinker://{params['model_id']}/{params['checkpoint_id']}"
        self.front.checkpoints.remove(owner, path)
        return {}

    async def weights_info(self, request: Request, owner: str) -> dict:
        path = str((await self.front.parse_body(request)).get("tinker_path", ""))
        try:
            parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)
        except ValueError as err:
            raise Refused(400, str(err)) from None
        model_id = parsed.training_run_id
        self.front.checkpoints.get(owner, path, parsed.checkpoint_id.split("/")[0])
        return {
            "base_model": self.front.limits.model_name,
            "is_lora": True,
            "lora_rank": self._run(owner, model_id).lora_rank,
        }


def _page(request: Request, items: list, default_limit: int) -> tuple[list, dict]:
    """``items[offset:offset + limit]`` by the query's ``offset`` and ``limit``, and its
    cursor."""
    try:
        limit = int(request.query_params.get("limit", default_limit))
        offset = int(request.query_params.get("offset", 0))
    except ValueError:
        raise Refused(400, "limit and offset must be integers") from None
    if limit < 1 or offset < 0:
        raise Refused(400, f"limit {limit}, offset {offset}: limit >= 1, offset >= 0")
    return (
        items[offset : offset + limit],
        {"offset": offset, "limit": limit, "total_count": len(items)},
    )

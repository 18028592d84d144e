"""What a request must satisfy before it reaches the engine (the run's limits), and the
engine's arguments it becomes; a refusal names the request's part and the limit."""

from __future__ import annotations

import dataclasses
import math
import uuid
from typing import Any

import numpy as np
from starlette.responses import JSONResponse
from tinker import types

from megatron_multilora.api import wire
from megatron_multilora.training.objectives.registry import CLIENT_LOSSES

# The SDK's simplest paths: plain API keys, uncompressed bodies sent one by one, a future
# polled per call. Its default transport (pyqwest) stays on: on httpx's, tinker 0.38 left a
# retrieve_future answer unread in its socket at the cookbook loop's first step (every run
# tried) and waited out its 45 s read timeout.
CLIENT_CONFIG = types.ClientConfigResponse(
    pjwt_auth_enabled=False,
    proto_compress_fwdbwd=False,
    parallel_fwdbwd_chunks=False,
    use_pyqwest_transport=True,
    sample_use_retrieve_futures=False,
    custom_loss_server_side=False,
    sample_join_sampling_session=False,
).model_dump()


class Refused(Exception):
    """A request answered with ``status`` and ``message`` (nothing was changed)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the run serves: its base model's name, vocabulary and longest sequence, its
    device slots and their largest rank, the training clients it holds at once (``clients``;
    None: one per slot; beyond the slots they are paged); ``tokenizer_id`` (a local folder)
    for the SDK's ``get_tokenizer``."""

    model_name: str
    vocab_size: int
    max_seq_len: int
    slots: int
    max_rank: int
    tokenizer_id: str | None
    unembed: bool = False  # the output layer is adapted (lora.targets has output_layer)
    clients: int | None = None
    clients_bound: str = "api.max_training_clients"  # what the 429 names

    @property
    def max_clients(self) -> int:
        return self.clients or self.slots


def check_optimizer(config: Any) -> None:
    """A client's optimizer, chosen at creation: AdamW. Tinker's Dimuon is refused here,
    not at its first step: its documentation leaves its update undefined (the matrix-sign
    iteration count, the normalisation epsilon and the preconditioner's form are internal)."""
    kind = getattr(config, "type", "adamw")
    if kind != "adamw":
        raise Refused(
            400,
            f"optimizer {kind!r}: not served (Tinker does not publish its full update); "
            "create with types.AdamOptimizerConfig() (the default)",
        )


def lora_parts(lora: types.LoraConfig, limits: Limits) -> list[str]:
    """The parts of the model a client's LoRA trains (its ``LoraConfig``)."""
    parts = [p for p in ("attn", "mlp", "unembed") if getattr(lora, f"train_{p}")]
    if not parts:
        raise Refused(400, "LoraConfig: train_attn, train_mlp and train_unembed are all off")
    if "unembed" in parts and not limits.unembed:
        raise Refused(
            400,
            "LoraConfig.train_unembed: this service adapts no output layer (its lora.targets "
            "lacks output_layer): create with train_unembed=False, or serve with it",
        )
    return parts


def loss_config(loss_fn: str, given: dict[str, Any]) -> dict[str, float]:
    """The loss's ``loss_fn_config``: the client's keys over the loss's defaults."""
    if loss_fn not in CLIENT_LOSSES:
        raise Refused(400, f"loss_fn {loss_fn!r}: this service computes {', '.join(CLIENT_LOSSES)}")
    defaults = CLIENT_LOSSES[loss_fn].config
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise Refused(
            400,
            f"loss_fn_config {', '.join(unknown)}: {loss_fn} takes "
            f"{', '.join(defaults) or 'no loss_fn_config'}",
        )
    config = dict(defaults)
    for key, value in given.items():
        if isinstance(value, str) or not math.isfinite(value):
            raise Refused(400, f"loss_fn_config {key}={value!r}: a finite number")
        config[key] = float(value)
    problems = CLIENT_LOSSES[loss_fn].config_problems(config)
    if problems:
        raise Refused(400, f"loss_fn_config of {loss_fn}: {'; '.join(problems)}")
    return config


def datum_example(i: int, datum: wire.Datum, loss_fn: str, limits: Limits) -> dict:
    """A datum as an example: its tokens, its target tokens where they are not the next
    ones, the loss's per-position inputs, and its provenance where the loss reads it."""
    tokens, n, where = datum.tokens, len(datum.tokens), f"datum {i}"
    check_tokens(tokens, where, limits)
    if n + 1 > limits.max_seq_len:
        raise Refused(
            400,
            f"{where}: {n} tokens; at most {limits.max_seq_len - 1} "
            "(trainer.max_seq_len, with its last target)",
        )
    targets = datum.inputs.get("target_tokens")
    if targets is None or targets.shape != (n,):
        raise Refused(
            400, f"{where}: loss_fn_inputs.target_tokens must have one target per input token ({n})"
        )
    check_tokens(targets.tolist(), f"{where} target_tokens", limits)
    loss = CLIENT_LOSSES[loss_fn]
    reads = ("target_tokens", *loss.inputs, *loss.optional)
    unknown = sorted(set(datum.inputs) - set(reads))
    if unknown:
        raise Refused(
            400,
            f"{where}: loss_fn_inputs {', '.join(unknown)}: not served with {loss_fn} "
            f"(it reads {', '.join(reads)})",
        )
    values = {}
    for name in loss.inputs + loss.optional:
        value = datum.inputs.get(name)
        if value is None and name in loss.optional:  # the positions it trains
            value = (datum.inputs["advantages"] != 0).astype(np.float32)
        if value is None or value.shape != (n,):
            raise Refused(
                400, f"{where}: loss_fn_inputs.{name} must have one value per input token ({n})"
            )
        if not np.isfinite(value).all():
            raise Refused(400, f"{where}: loss_fn_inputs.{name} has non-finite values")
        values[name] = tuple(float(v) for v in value)
    shifted = np.array_equal(targets[:-1], np.asarray(tokens[1:]))
    example = {
        "tokens": list(tokens) + [int(targets[-1])],
        "targets": None if shifted else targets.tolist(),
        "values": values,
    }
    if loss.provenance:
        example["spans"] = provenance(datum, loss_fn, where)
    return example


def provenance(datum: wire.Datum, loss_fn: str, where: str) -> tuple[list, list]:
    """The datum's provenance runs (of its model input, of its targets), each tiling its
    field; a loss that reads the recorded samples needs them."""
    if datum.input_spans is None or datum.target_spans is None:
        raise Refused(
            400,
            f"{where}: {loss_fn} needs provenance on every datum "
            "(Datum.with_provenance, naming the sequence_ids of samples drawn in this "
            "session by a sampling client made with record_stability_info=True)",
        )
    for field, spans in (("model_input", datum.input_spans), ("target_tokens", datum.target_spans)):
        if sum(length for *_, length in spans) != len(datum.tokens):
            raise Refused(
                400,
                f"{where}: the {field} provenance runs do not tile its {len(datum.tokens)} positions",
            )
    return datum.input_spans, datum.target_spans


def check_tokens(tokens: list[int], where: str, limits: Limits) -> None:
    if not tokens:
        raise Refused(400, f"{where}: no tokens")
    bad = [t for t in tokens if not 0 <= t < limits.vocab_size]
    if bad:
        raise Refused(
            400,
            f"{where}: token id {bad[0]} is outside the vocabulary (0 to {limits.vocab_size - 1})",
        )


def sample_args(body: types.SampleRequest, sampler_id: str, limits: Limits) -> dict:
    """A sample request as the engine's arguments (its prompt, limits, sampling, key)."""
    params = body.sampling_params
    asked = [
        name
        for name, value in (
            ("topk_prompt_logprobs", body.topk_prompt_logprobs),
            ("topk_sample_logprobs", body.topk_sample_logprobs),
            ("target_prompt_logprobs", body.target_prompt_logprobs),
            ("prompt_alt_tokens_k", body.prompt_alt_tokens_k),
            ("prompt_logprobs_last_n", body.prompt_logprobs_last_n),
        )
        if value
    ]
    if asked:
        raise Refused(
            400,
            f"{', '.join(asked)}: not served (prompt_logprobs=True gives the prompt's log-probs)",
        )
    prompt = body.prompt.to_ints()
    check_tokens(prompt, "prompt", limits)
    max_tokens = params.max_tokens or 16
    if len(prompt) + max_tokens > limits.max_seq_len:
        raise Refused(
            400,
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) is "
            f"over trainer.max_seq_len={limits.max_seq_len}",
        )
    if params.top_k not in (-1, 0, None):
        raise Refused(400, "sampling_params.top_k: not served (use top_p)")
    stop = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    if not (all(isinstance(s, int) for s in stop) or all(isinstance(s, str) and s for s in stop)):
        raise Refused(
            400,
            "sampling_params.stop: stop token ids (ints) or stop strings (non-empty), not a mix",
        )
    if not 1 <= body.num_samples <= 256:
        raise Refused(400, f"num_samples={body.num_samples}: 1 to 256")
    if not (params.temperature >= 0 and 0 < params.top_p <= 1):
        raise Refused(
            400, "sampling_params: temperature must be >= 0 (0: greedy) and top_p in (0, 1]"
        )
    # Draws keyed by the seed (the same seed: the same samples) or by the request.
    key = (
        f"seed:{params.seed}"
        if params.seed is not None
        else f"{sampler_id}:{body.seq_id}:{uuid.uuid4().hex}"
    )
    return {
        "prompt": prompt,
        "num_samples": body.num_samples,
        "max_tokens": max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stop": [s for s in stop if isinstance(s, int)],
        "stop_strings": [s for s in stop if isinstance(s, str)],
        "key": key,
        "prompt_logprobs": bool(body.prompt_logprobs),
        "record": bool(body.record_stability_info),
    }


def refusal(status: int, message: str) -> JSONResponse:
    # Always a body (an empty 400 is retried by the SDK as a proxy glitch).
    return JSONResponse(
        {"detail": message}, status_code=status, headers={"x-should-retry": "false"}
    )

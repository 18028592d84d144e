"""The SDK's protobuf bodies, in the direction a server needs: ``ForwardBackwardRequest``
in, ``ForwardBackwardOutput`` and ``SampleResponse`` out, with the SDK's own message
classes (``tinker.proto.tinker_public_pb2``; the SDK converts only the other way). Every
other request and answer is JSON of ``tinker.types``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

PROTOBUF = "application/x-protobuf"
_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}


class WireError(ValueError):
    """A body the service cannot read; the message says what (answered as 400)."""


# A provenance run: ("prompt" or "sampled", the sample's sequence_id, offset, length).
Span = tuple[str, str, int, int]


@dataclasses.dataclass
class Datum:
    tokens: list[int]  # the model input
    inputs: dict[str, np.ndarray]  # loss_fn_inputs by name, each [len(tokens)]
    input_spans: list[Span] | None = None  # provenance of the model input
    target_spans: list[Span] | None = None  # provenance of the target tokens


@dataclasses.dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, Any]
    forward_only: bool
    data: list[Datum]


def _tensor(t: Any) -> np.ndarray:
    if t.dtype not in _DTYPES:
        raise WireError(f"tensor dtype {t.dtype}: only float32 and int64 inputs are read")
    dtype = _DTYPES[t.dtype]
    if t.HasField("sparse_csr"):
        values = np.frombuffer(t.sparse_csr.values, dtype=dtype)
        rows = np.frombuffer(t.sparse_csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(t.sparse_csr.col_indices, dtype=np.int64)
        dense = np.zeros(list(t.shape), dtype=dtype)
        for r in range(len(rows) - 1):
            dense[r, cols[rows[r] : rows[r + 1]]] = values[rows[r] : rows[r + 1]]
        return dense
    array = np.frombuffer(t.dense, dtype=dtype)
    return array.reshape(list(t.shape)) if len(t.shape) else array


def read_forward_backward(body: bytes) -> ForwardBackward:
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as err:  # protobuf's DecodeError and kin
        raise WireError(f"not a ForwardBackwardRequest protobuf: {err}") from None
    data = []
    for i, datum in enumerate(message.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof(chunk.DESCRIPTOR.oneofs[0].name)
            if kind != "encoded_text":
                raise WireError(
                    f"datum {i}: model_input chunk {kind!r}: only token chunks "
                    "(encoded_text) are served"
                )
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        inputs = {name: _tensor(t) for name, t in datum.loss_fn_inputs.items()}
        spans = [_spans(datum.model_input_spans), _spans(datum.loss_fn_input_spans)]
        data.append(Datum(tokens, inputs, *spans))
    config = {
        k: (v.text if v.WhichOneof("value") == "text" else v.number)
        for k, v in message.loss_fn_config_v2.items()
    } or dict(message.loss_fn_config)
    return ForwardBackward(
        message.model_id, message.seq_id, message.loss_fn, config, message.forward_only, data
    )


def _spans(message: Any) -> list[Span] | None:
    out = []
    for span in message:
        kind = span.WhichOneof("span")
        arm = span.prompt_tokens if kind == "prompt_tokens" else span.sampled_tokens
        out.append(
            (
                "prompt" if kind == "prompt_tokens" else "sampled",
                arm.sequence_id,
                arm.offset,
                arm.length,
            )
        )
    return out or None


def forward_backward_output(
    per_datum: list[dict[str, list[float]]], metrics: dict[str, float]
) -> bytes:
    """Each datum's float32 outputs by name (e.g. ``logprobs``) and the call's metrics
    (keys ``name:reduction``, as the SDK splits them)."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(per_datum))
    for name in per_datum[0] if per_datum else ():
        arrays = [np.asarray(d[name], dtype=np.float32).ravel() for d in per_datum]
        field = record.fields[name]
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64).tobytes()
        field.dtype = pb.DTYPE_FLOAT32
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    out.loss_fn_outputs.append(record)
    return out.SerializeToString()


def sample_response(
    sequences: list[tuple[list[int], list[float], bool]], prompt_logprobs: list[float] | None
) -> bytes:
    """Each sample's tokens, their log-probs and whether it stopped (else: its length
    limit); the prompt's log-probs (NaN for its first token) when asked for."""
    out = pb.SampleResponse()
    for tokens, logprobs, stopped in sequences:
        sequence = out.sequences.add()
        sequence.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        sequence.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
        sequence.stop_reason = pb.STOP_REASON_STOP if stopped else pb.STOP_REASON_LENGTH
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return out.SerializeToString()

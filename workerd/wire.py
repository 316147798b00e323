"""wire.py: every message between the coordinator and a workerd, and their framing.

A message travels as a ZeroMQ multipart `[kind, payload]` or, when it carries tensors,
`[kind, payload, index, *buffers]`: `kind` is the class name, `payload` the orjson of the
dataclass, `index` an orjson list of `[name, dtype, shape]` describing each raw buffer.
This module imports only the standard library and orjson (a test asserts it): it is not
where helpers, torch conversions or socket code live.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

# The backend names both sides speak (Register.backends; the run config's engine_backend and
# trainer_backend, checked by the coordinator); workerd/backends.py maps each to what it needs.
ENGINE_BACKENDS = ("cpu", "sglang")
TRAINER_BACKENDS = ("cpu", "megatron")


class GyreError(Exception):
    """Base of gyre's domain errors: the CLI prints them on one line."""


class WireError(GyreError, ValueError):
    """A frame sequence that does not decode to a known message."""


class TensorFrame(NamedTuple):
    """One raw tensor buffer: `dtype` is a torch dtype name ("float32", "bfloat16", ...)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: Any  # a buffer: bytes, memoryview, numpy array, zmq.Frame


def _msg(cls):
    return dataclass(frozen=True, slots=True, kw_only=True)(cls)


# --- workerd -> coordinator: lifecycle --------------------------------------------------


@_msg
class Register:
    """First message of a workerd; answered by `Welcome`."""

    req_id: int
    node_id: str
    cell: int | None  # None: the coordinator assigns one
    node_rank: int
    host: str
    pid: int
    devices: list[str]
    backends: dict[str, str]  # {"engine": "cpu", "trainer": "cpu"}


@_msg
class Ready:
    """The workerd has built its backends from the Welcome's model and holds `role`."""

    node_id: str
    role: str
    version: int
    params: int
    load_seconds: float


@_msg
class Heartbeat:
    node_id: str
    role: str
    running: int  # rollout requests in flight
    version: int
    t: float


@_msg
class Deregister:
    """Sent on a graceful shutdown after in-flight work was finished or handed back."""

    node_id: str
    reason: str


@_msg
class WorkerDead:
    """Sent before a workerd exits on a fatal error."""

    node_id: str
    reason: str
    traceback: str


# --- coordinator -> workerd: commands ---------------------------------------------------


@_msg
class Welcome:
    req_id: int
    node_id: str
    cell: int
    role: str  # "rollout" | "training"
    model_dir: str
    engine: dict[str, Any] = field(default_factory=dict)  # opaque backend options
    trainer: dict[str, Any] = field(default_factory=dict)
    heartbeat_s: float = 1.0


@_msg
class Generate:
    """Start one rollout request; answered by a stream of `GenerateChunk`s sharing req_id."""

    req_id: int
    rid: str  # the proxy's request id, used to abort
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    kv_tokens: int = 0  # frames "k.L"/"v.L" hold the KV of the first kv_tokens prompt tokens


@_msg
class Abort:
    req_id: int
    rid: str


@_msg
class SetRole:
    """Change role; replied to with `RoleChanged` once the switch is complete."""

    req_id: int
    role: str


@_msg
class TrainMicroStep:
    """One packed micro-step. Tensors (all [rows, T]): input_ids, target_mask,
    behaviour_logprobs, advantages, loss_weights, exec_ids (execution index per token)."""

    req_id: int
    step: int


@_msg
class OptimizerStep:
    """Reduce accumulated gradients (over `group` if set), normalise by the number of
    executions in the batch, clip, apply one update; the policy version advances by one."""

    req_id: int
    num_executions: int
    apply: bool = True  # False on satellites: take part in the reduction, leave the update to the core


@_msg
class ExportWeights:
    """Reply `Weights` carries every parameter by its Hugging Face name."""

    req_id: int


@_msg
class LoadWeights:
    """Load named tensors (frames) into the rollout engine (if `engine`) and the trainer
    (if `trainer`). With no frames, the engine copies this node's own trainer."""

    req_id: int
    version: int
    trainer: bool = False
    engine: bool = True


@_msg
class Call:
    """Rare control operations: save_checkpoint, load_checkpoint, stats, echo, ..."""

    req_id: int
    method: str
    args: dict[str, Any] = field(default_factory=dict)


@_msg
class Shutdown:
    req_id: int
    reason: str = ""


@_msg
class Reregister:
    """From a coordinator that does not know this node (it restarted, e.g. `gyre up
    --resume`): drop the session's state and register again."""

    reason: str = ""


# --- workerd -> coordinator: replies ----------------------------------------------------


@_msg
class GenerateChunk:
    """Newly sampled tokens of one request; the last chunk has `finished` set."""

    req_id: int
    rid: str
    token_ids: list[int]
    logprobs: list[float]
    version: int
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    prompt_tokens: int = 0
    kv_tokens: int = 0  # a handed-back request: frames carry its KV for this many context tokens


@_msg
class RoleChanged:
    req_id: int
    role: str
    seconds: float
    freed_bytes: int = 0


@_msg
class TrainResult:
    req_id: int
    loss: float
    tokens: int
    executions: int
    seconds: float
    mismatch_kl: float  # mean(b - l) over targets: engine/trainer gap, a health signal


@_msg
class StepResult:
    req_id: int
    version: int
    grad_norm: float
    seconds: float


@_msg
class Weights:
    req_id: int
    version: int
    nbytes: int


@_msg
class Loaded:
    req_id: int
    version: int
    seconds: float
    nbytes: int


@_msg
class CallResult:
    req_id: int
    error: str | None = None
    result: Any = None


@_msg
class Error:
    """The command `req_id` failed; `kind` names the exception class."""

    req_id: int
    kind: str
    message: str


WIRE_TYPES: dict[bytes, type] = {
    cls.__name__.encode(): cls
    for cls in (
        Register, Ready, Heartbeat, Deregister, WorkerDead,
        Welcome, Generate, Abort, SetRole, TrainMicroStep, OptimizerStep, ExportWeights,
        LoadWeights, Call, Shutdown, Reregister,
        GenerateChunk, RoleChanged, TrainResult, StepResult, Weights, Loaded, CallResult, Error,
    )
}

# Messages a workerd receives (each must have a handler in the worker's table).
WORKER_COMMANDS: tuple[type, ...] = (
    Welcome, Generate, Abort, SetRole, TrainMicroStep, OptimizerStep, ExportWeights,
    LoadWeights, Call, Shutdown, Reregister,
)


def encode(msg: Any, tensors: list[TensorFrame] | None = None) -> list[Any]:
    frames: list[Any] = [type(msg).__name__.encode(), orjson.dumps(msg)]
    if tensors:
        frames.append(orjson.dumps([[t.name, t.dtype, list(t.shape)] for t in tensors]))
        frames.extend(t.data for t in tensors)
    return frames


def decode(frames: list[Any]) -> tuple[Any, list[TensorFrame]]:
    """Frames (bytes or zmq.Frame) -> (message, tensors). Raises WireError, never worse."""
    if len(frames) < 2:
        raise WireError(f"expected at least 2 frames, got {len(frames)}")
    kind = _bytes(frames[0])
    cls = WIRE_TYPES.get(kind)
    if cls is None:
        raise WireError(f"unknown message kind {kind[:64]!r}")
    try:
        msg = cls(**orjson.loads(_bytes(frames[1])))
    except (orjson.JSONDecodeError, TypeError) as e:
        raise WireError(f"bad {cls.__name__} payload: {e}") from None
    tensors: list[TensorFrame] = []
    if len(frames) > 2:
        index = orjson.loads(_bytes(frames[2]))
        if len(index) != len(frames) - 3:
            raise WireError(f"tensor index names {len(index)} buffers, {len(frames) - 3} sent")
        for (name, dtype, shape), frame in zip(index, frames[3:]):
            data = frame.buffer if hasattr(frame, "buffer") else frame
            tensors.append(TensorFrame(name, dtype, tuple(shape), data))
    return msg, tensors


def req_id_of(frames: list[Any]) -> int | None:
    """Best-effort request id of an undecodable message, so its error reply can echo it."""
    try:
        value = orjson.loads(_bytes(frames[1])).get("req_id")
        return value if isinstance(value, int) else None
    except Exception:  # noqa: BLE001 - any garbage means "no id"
        return None


def _bytes(frame: Any) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)

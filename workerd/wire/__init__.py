"""wire: every message between the coordinator and a workerd, and their framing.

A message travels as a ZeroMQ multipart `[kind, payload]` or, when it carries tensors,
`[kind, payload, index, *buffers]`: `kind` is the class name, `payload` the orjson of the
dataclass, `index` an orjson list of `[name, dtype, shape]` describing each raw buffer.
Every command carries `req_id`; `REPLIES` names the typed reply each request is answered
with (any may be answered with `Error`). The generic `Call` is for diagnostics only.
This package imports only the standard library and orjson (a test asserts it): it is not
where helpers, torch conversions or socket code live.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson

from gyre.workerd.wire.messages import (  # noqa: F401 - re-exported: wire.X is the protocol's one name
    PROMPT_FRAME,
    Abort,
    Aborted,
    Call,
    CallResult,
    CheckpointLoaded,
    CloseRelay,
    Deregister,
    Done,
    EngineSpec,
    Error,
    ExportWeights,
    Generate,
    GenerateChunk,
    Heartbeat,
    InitReducer,
    LoadCheckpoint,
    Loaded,
    LoadWeights,
    OpenRelay,
    OptimizerStep,
    Ready,
    Register,
    RelayClosed,
    RelayOpened,
    Reregister,
    RoleChanged,
    SaveCheckpoint,
    SetParticipants,
    SetRole,
    Shutdown,
    Stats,
    StepResult,
    TrainerSpec,
    TrainMicroStep,
    TrainResult,
    Weights,
    Welcome,
    WorkerDead,
    WorkerStats,
)
from gyre.workerd.wire.steps import (  # noqa: F401 - re-exported: wire.X is the protocol's one name
    ADVANTAGES,
    BEHAVIOUR_LOGPROBS,
    EXEC_IDS,
    INPUT_IDS,
    LOSS_WEIGHTS,
    MICRO_STEP_TENSORS,
    TARGET_MASK,
    TREE_EXEC_ADVANTAGE,
    TREE_EXEC_INDEX,
    TREE_EXEC_LOSS_WEIGHT,
    TREE_INPUT_IDS,
    TREE_SEG_EXEC,
    TREE_SEG_LEN,
    TREE_SEG_PARENT,
    TREE_SEG_TARGET,
    TREE_STEP_TENSORS,
    TREE_TARGET_LOGPROBS,
)
from gyre.workerd.wire.weights import (  # noqa: F401 - re-exported: wire.X is the protocol's one name
    BroadcastJoined,
    BroadcastWeights,
    InitBroadcast,
    InitTransfer,
    OfferWeights,
    PrepareBroadcast,
    PullWeights,
    ReceiveWeights,
    TensorSpecs,
    TransferReady,
    WeightOffer,
    WeightSpecs,
    WeightsReceived,
    WeightsSent,
)

# The backend names both sides speak (Register.backends; the run config's engine_backend and
# trainer_backend, checked by the coordinator); workerd/backends.py maps each to what it needs.
ENGINE_BACKENDS = ("cpu", "sglang")
TRAINER_BACKENDS = ("cpu", "megatron")


class GyreError(Exception):
    """Base of gyre's domain errors: the CLI prints them on one line."""


class WireError(GyreError, ValueError):
    """A frame sequence that does not decode to a known message."""


class BackendError(GyreError):
    """An unknown backend, one whose package is not installed, or an option it does not
    know (workerd refuses them; an Error reply names this class)."""


class TensorFrame(NamedTuple):
    """One raw tensor buffer: `dtype` is a torch dtype name ("float32", "bfloat16", ...)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: Any  # a buffer: bytes, memoryview, numpy array, zmq.Frame


# Messages a workerd receives (each must have a handler in the worker's table).
WORKER_COMMANDS: tuple[type, ...] = (
    Welcome, Generate, Abort, SetRole, TrainMicroStep, OptimizerStep, ExportWeights,
    LoadWeights, Call, Shutdown, Reregister,
    InitReducer, SetParticipants, SaveCheckpoint, LoadCheckpoint, Stats, OpenRelay, CloseRelay,
    InitTransfer, OfferWeights, PullWeights, InitBroadcast, WeightSpecs, PrepareBroadcast,
    BroadcastWeights, ReceiveWeights,
)

# The reply (by req_id) each request/reply command is answered with, when it succeeds; any
# command may be answered with `Error` instead. Generate streams GenerateChunks, Welcome is
# answered by Ready, Reregister by a new Register.
REPLIES: dict[type, type] = {
    Abort: Aborted, SetRole: RoleChanged, TrainMicroStep: TrainResult, OptimizerStep: StepResult,
    ExportWeights: Weights, LoadWeights: Loaded, Call: CallResult, Shutdown: Done,
    InitReducer: Done, SetParticipants: Done, SaveCheckpoint: Done, LoadCheckpoint: CheckpointLoaded,
    Stats: WorkerStats, OpenRelay: RelayOpened, CloseRelay: RelayClosed,
    InitTransfer: TransferReady, OfferWeights: WeightOffer, PullWeights: WeightsReceived,
    InitBroadcast: BroadcastJoined, WeightSpecs: TensorSpecs, PrepareBroadcast: Done,
    BroadcastWeights: WeightsSent, ReceiveWeights: WeightsReceived,
}

# Welcome's typed options: fields of a message, never sent alone (not in WIRE_TYPES).
OPTION_SPECS: tuple[type, ...] = (EngineSpec, TrainerSpec)

WIRE_TYPES: dict[bytes, type] = {
    cls.__name__.encode(): cls
    for cls in (
        Register, Ready, Heartbeat, Deregister, WorkerDead,
        *WORKER_COMMANDS,
        GenerateChunk, RoleChanged, TrainResult, StepResult, Weights, Loaded, Done, Aborted,
        CheckpointLoaded, WorkerStats, RelayOpened, RelayClosed, TransferReady, WeightOffer,
        BroadcastJoined, TensorSpecs, WeightsSent, WeightsReceived, CallResult, Error,
    )
}


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

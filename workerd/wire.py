"""wire.py: every message between the coordinator and a workerd, and their framing.

A message travels as a ZeroMQ multipart `[kind, payload]` or, when it carries tensors,
`[kind, payload, index, *buffers]`: `kind` is the class name, `payload` the orjson of the
dataclass, `index` an orjson list of `[name, dtype, shape]` describing each raw buffer.
Every command carries `req_id`; `REPLIES` names the typed reply each request is answered
with (any may be answered with `Error`). The generic `Call` is for diagnostics only.
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


class BackendError(GyreError):
    """An unknown backend, one whose package is not installed, or an option it does not
    know (workerd refuses them; an Error reply names this class)."""


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
    """One packed micro-step: path rows (`MICRO_STEP_TENSORS`, all [rows, T]) or a tree of
    unique segments (`TREE_STEP_TENSORS`)."""

    req_id: int
    step: int


# TrainMicroStep's tensor frames by name, with their dtypes: the coordinator's packing.py
# writes them, the trainers' MicroBatch reads them.
INPUT_IDS = "input_ids"
TARGET_MASK = "target_mask"  # the token at [r, t] is a trained target
BEHAVIOUR_LOGPROBS = "behaviour_logprobs"  # the engine's log-prob of each target
ADVANTAGES = "advantages"  # the execution's advantage on its targets
LOSS_WEIGHTS = "loss_weights"  # 1 / L_i on targets
EXEC_IDS = "exec_ids"  # execution index per token, batch-wide
MICRO_STEP_TENSORS: dict[str, str] = {
    INPUT_IDS: "int64", TARGET_MASK: "bool", BEHAVIOUR_LOGPROBS: "float32",
    ADVANTAGES: "float32", LOSS_WEIGHTS: "float32", EXEC_IDS: "int64",
}
# A micro-step in tree form (packing = "tree"): each unique token once, with the structure
# the worker rebuilds positions, ancestry and per-token fields from (trainers/tree.py).
TREE_INPUT_IDS = "tree.ids"  # [N] the unique tokens, segment after segment (uint16 where the vocabulary fits)
TREE_SEG_LEN = "tree.seg_len"  # [S] tokens of each segment (a tree node)
TREE_SEG_PARENT = "tree.seg_parent"  # [S] its parent segment, before it (-1: a root)
TREE_SEG_EXEC = "tree.seg_exec"  # [S] its execution, an index into the exec arrays
TREE_SEG_TARGET = "tree.seg_target"  # [S] its tokens are trained targets
TREE_TARGET_LOGPROBS = "tree.target_logprobs"  # [targets] behaviour log-probs, in token order
TREE_EXEC_ADVANTAGE = "tree.exec_advantage"  # [E]
TREE_EXEC_LOSS_WEIGHT = "tree.exec_loss_weight"  # [E] 1 / L_i of the whole execution
TREE_EXEC_INDEX = "tree.exec_index"  # [E] execution index, batch-wide
TREE_STEP_TENSORS: dict[str, str] = {
    TREE_INPUT_IDS: "int32", TREE_SEG_LEN: "int32", TREE_SEG_PARENT: "int32", TREE_SEG_EXEC: "int32",
    TREE_SEG_TARGET: "bool", TREE_TARGET_LOGPROBS: "float32", TREE_EXEC_ADVANTAGE: "float32",
    TREE_EXEC_LOSS_WEIGHT: "float32", TREE_EXEC_INDEX: "int32",
}


@_msg
class OptimizerStep:
    """Reduce accumulated gradients over the prefix group of the participants (the last
    `SetParticipants`), normalise by `num_executions`, clip, and apply one update if `apply`:
    the policy version then advances by one."""

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
    """Diagnostics only: `echo`, `fail` (the RPC path and its error path, in tests) and
    `logprobs` (the trainer's log-probs of given rows, for consistency checks). Every
    operation the coordinator relies on has a typed message of its own."""

    req_id: int
    method: str
    args: dict[str, Any] = field(default_factory=dict)


@_msg
class Shutdown:
    """Exit after answering `Done`."""

    req_id: int
    reason: str = ""


@_msg
class Reregister:
    """From a coordinator that does not know this node (it restarted, e.g. `gyre up
    --resume`): drop the session's state and register again."""

    reason: str = ""


# --- coordinator -> workerd: reduction, checkpoints, diagnostics, relays -----------------


@_msg
class InitReducer:
    """Join the cells' gradient-reduction world (blocks until every cell joined)."""

    req_id: int
    rank: int
    world_size: int
    init_method: str  # a torch.distributed rendezvous URL: "tcp://host:port", "file://..."


@_msg
class SetParticipants:
    """The next OptimizerStep reduces over the first `participants` cells."""

    req_id: int
    participants: int


@_msg
class SaveCheckpoint:
    """The trainer's state (parameters, optimizer, version) to `path` on the node."""

    req_id: int
    path: str


@_msg
class LoadCheckpoint:
    req_id: int
    path: str


@_msg
class Stats:
    req_id: int


@_msg
class OpenRelay:
    """A proxy listener inside process `pid`'s network namespace (a sandbox on this node's
    host) relaying to the coordinator's proxy on `proxy_port`."""

    req_id: int
    pid: int  # in this host's pid namespace
    proxy_port: int


@_msg
class CloseRelay:
    req_id: int
    relay: int  # RelayOpened.relay


# --- coordinator -> workerd: weight transfer beside ExportWeights/LoadWeights ------------


@_msg
class InitTransfer:
    """Start the weight-transfer backend (only "mooncake" for now) listening on `host`."""

    req_id: int
    backend: str
    host: str


@_msg
class OfferWeights:
    """Make the trainer's parameters at `version` pullable by other nodes (Mooncake)."""

    req_id: int
    version: int


@_msg
class PullWeights:
    """Pull another node's offer into this node's engine and/or trainer."""

    req_id: int
    handle: dict[str, Any]  # WeightOffer.handle, opaque to the coordinator
    engine: bool
    trainer: bool


@_msg
class InitBroadcast:
    """Join the weight-broadcast group (blocks until every cell joined; the core is rank 0)."""

    req_id: int
    master_address: str
    master_port: int
    rank: int
    world_size: int


@_msg
class WeightSpecs:
    """The name, dtype and shape of every trainer parameter, in broadcast order."""

    req_id: int


@_msg
class PrepareBroadcast:
    """The core exports (and checks) `version` before any receiver enters the collective."""

    req_id: int
    version: int


@_msg
class BroadcastWeights:
    """The core sends the prepared `version` to every other member."""

    req_id: int
    version: int


@_msg
class ReceiveWeights:
    """A member receives the core's broadcast of `version` (tensors as the core's
    `TensorSpecs` lists them) into its engine and/or trainer."""

    req_id: int
    version: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    engine: bool
    trainer: bool


# --- workerd -> coordinator: replies ----------------------------------------------------


@_msg
class Done:
    """A command that returns nothing but success (InitReducer, SetParticipants,
    SaveCheckpoint, PrepareBroadcast, Shutdown) completed."""

    req_id: int


@_msg
class Aborted:
    req_id: int
    found: bool  # False: the request had finished already, or was never here


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
    # Prompt tokens whose KV the engine reused (its prefix cache, or KV handed over) instead of
    # computing them; None: the engine does not say (never read as zero).
    cached_tokens: int | None = None


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
class CheckpointLoaded:
    req_id: int
    version: int  # the trainer's version after loading


@_msg
class WorkerStats:
    req_id: int
    node_id: str
    cell: int | None
    role: str
    running: int  # rollout requests in flight
    version: int  # the engine's (-1 before Welcome)
    trainer_version: int
    peak_rss_bytes: int  # this process's peak resident memory so far


@_msg
class RelayOpened:
    req_id: int
    relay: int  # names it to CloseRelay
    port: int  # the listener's port inside the sandbox's namespace


@_msg
class RelayClosed:
    req_id: int
    closed: bool  # False: no such relay (closed already)


@_msg
class TransferReady:
    req_id: int
    session: str  # this node's Mooncake session ("host:port")


@_msg
class WeightOffer:
    req_id: int
    version: int
    nbytes: int
    handle: dict[str, Any]  # opaque: what a PullWeights on another node needs


@_msg
class BroadcastJoined:
    req_id: int
    rank: int
    backend: str  # "nccl" | "gloo"


@_msg
class TensorSpecs:
    req_id: int
    names: list[str]
    dtypes: list[str]  # torch dtype names ("float32", "bfloat16", ...)
    shapes: list[list[int]]


@_msg
class WeightsSent:
    req_id: int
    version: int
    nbytes: int
    seconds: float


@_msg
class WeightsReceived:
    """Pulled or received weights are loaded: `transfer_seconds` on the wire, `seconds` in all."""

    req_id: int
    version: int
    nbytes: int
    transfer_seconds: float
    seconds: float


@_msg
class CallResult:
    """The answer to a diagnostic `Call`."""

    req_id: int
    error: str | None = None
    result: Any = None


@_msg
class Error:
    """The command `req_id` failed; `kind` names the exception class."""

    req_id: int
    kind: str
    message: str


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

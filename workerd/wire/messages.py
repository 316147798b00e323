"""wire/messages.py: the coordinator <-> workerd messages but weight transfer's (wire/weights.py).

Each is a frozen keyword-only dataclass, sent as its class name and orjson payload
(wire/__init__.py frames them). Standard library only: not where helpers live.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


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
    # What it kept of an earlier coordinator's session, to be welcomed with again (a restart of
    # the same run): {"run", "cell", "version" (its engine's), "trainer_version"}; None: nothing.
    kept: dict[str, Any] | None = None


@_msg
class Ready:
    """The workerd has built its backends from the Welcome's model and holds `role`; `kept`:
    it took the ones it held instead (Welcome.run and .version matched), its engine at
    `version` and its trainer (weights and optimizer state) at `trainer_version`."""

    node_id: str
    role: str
    version: int
    params: int
    load_seconds: float
    kept: bool = False
    trainer_version: int | None = None


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


# A Welcome's options: gyre's own as typed fields, each default written here once (the
# backends and their constructors take theirs from these), and `options`, the backend's own
# passed through untouched (the run config's engine_options / trainer_options beyond gyre's:
# sglang's `server`; megatron's tp, pp, microbatches, offload). Not messages: fields of one.


class _Spec:
    __slots__ = ()

    def __post_init__(self) -> None:
        """Each typed field holds its type (an int given for a float becomes one), else
        TypeError naming it: decode answers that with a WireError."""
        for f in fields(self):
            value = getattr(self, f.name)
            kind, _, optional = f.type.partition(" | ")
            if f.name == "options":
                ok = isinstance(value, dict)
            elif value is None:
                ok = optional == "None"
            elif kind == "bool":
                ok = isinstance(value, bool)
            elif kind == "int":
                ok = isinstance(value, int) and not isinstance(value, bool)
            else:
                ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok:
                raise TypeError(f"{type(self).__name__}.{f.name} must be {f.type}, not {value!r}")
            if kind == "float" and value is not None:
                object.__setattr__(self, f.name, float(value))

    @classmethod
    def from_options(cls, values: dict[str, Any]):
        """Gyre's fields by name from one dict (a run's settings over its engine_options or
        trainer_options), everything else the backend's `options`."""
        own = {f.name for f in fields(cls)} - {"options"}
        return cls(**{k: v for k, v in values.items() if k in own},
                   options={k: v for k, v in values.items() if k not in own})


@_msg
class EngineSpec(_Spec):
    """A cell's rollout engine: the run config's seed, engine_max_running, prefix_cache_mb."""

    threads: int | None = None  # torch threads; None: torch's own (LocalCluster: cores / cells)
    seed: int = 0  # sampling; LocalCluster gives each cell its own
    max_running: int = 64  # requests batched at once
    prefix_cache_mb: int = 512  # the CPU engine's cache of finished requests' KV; 0: off (SGLang: its own)
    version: int = 0  # the weights' version at start
    options: dict[str, Any] = field(default_factory=dict)


@_msg
class TrainerSpec(_Spec):
    """A cell's trainer: the run config's lr, rollout_temperature, micro_step_tokens, plus
    what its trainer_options set of these fields."""

    # The run's: coordinator/runconfig.py resolves lr per model (its gyre.json, else
    # REAL_MODEL_LR, 1e-6: SmolLM2 learned stably at it); a test keeps the two equal.
    lr: float = 1e-6
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    temperature: float = 1.0  # the rollout temperature: log-probs of the distribution engines sample
    micro_step_tokens: int = 8192  # a micro-step's token budget (sizes activation recomputation)
    checkpoint_layers: bool | None = None  # CPU trainer: recompute activations; None: when they would pass ~2 GiB
    options: dict[str, Any] = field(default_factory=dict)


@_msg
class Welcome:
    req_id: int
    node_id: str
    cell: int
    role: str  # "rollout" | "training"
    model_dir: str
    engine: EngineSpec = field(default_factory=EngineSpec)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    heartbeat_s: float = 1.0
    # The run (rundir.run_id) and the version it resumes at: a workerd that kept its backends
    # from that run, built from the same model and specs, its trainer at that version, takes
    # them as they are instead of building new ones (a coordinator's restart costs no reload).
    run: str = ""
    version: int | None = None
    # The pid of a coordinator on this host that spawned the run's workerds: one that outlived the
    # earlier coordinator (--linger) follows this one now.
    coordinator_pid: int | None = None

    def __post_init__(self) -> None:
        # Decoded, the specs arrive as dicts (a frame is the orjson of the whole message).
        for name, cls in (("engine", EngineSpec), ("trainer", TrainerSpec)):
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, cls(**value))
            elif not isinstance(value, cls):
                raise TypeError(f"Welcome.{name} must be a {cls.__name__}, not {type(value).__name__}")


PROMPT_FRAME = "prompt"  # a Generate's prompt ids, when prompt_in_frame


@_msg
class Generate:
    """Start one rollout request; answered by a stream of `GenerateChunk`s sharing req_id."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)
    rid: str  # the proxy's request id, used to abort
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    kv_tokens: int = 0  # frames "k.L"/"v.L" hold the KV of the first kv_tokens prompt tokens
    # True: the prompt is the frame "prompt" (its ids as raw uint16/int32), prompt_ids empty.
    # The coordinator sends it so: a 100k-token list of ints costs its loop milliseconds.
    prompt_in_frame: bool = False


@_msg
class Abort:
    req_id: int = 0  # assigned by the link (WorkerLink.call)
    rid: str


@_msg
class SetRole:
    """Change role; replied to with `RoleChanged` once the switch is complete."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)
    role: str


@_msg
class TrainMicroStep:
    """One packed micro-step: path rows (`MICRO_STEP_TENSORS`, all [rows, T]) or a tree of
    unique segments (`TREE_STEP_TENSORS`)."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)
    step: int


@_msg
class OptimizerStep:
    """Reduce accumulated gradients over the prefix group of the participants (the last
    `SetParticipants`), normalise by `num_executions`, clip, and apply one update if `apply`:
    the policy version then advances by one."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)
    num_executions: int
    apply: bool = True  # False on satellites: take part in the reduction, leave the update to the core


@_msg
class ExportWeights:
    """Reply `Weights` carries every parameter by its Hugging Face name."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)


@_msg
class LoadWeights:
    """Load named tensors (frames) into the rollout engine (if `engine`) and the trainer
    (if `trainer`). With no frames, the engine copies this node's own trainer. `unchanged`:
    a publication of weights no update changed (a step that trained nothing): an engine that
    still holds `version` loads nothing; one that dropped its weights copies its trainer."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)
    version: int
    trainer: bool = False
    engine: bool = True
    unchanged: bool = False


@_msg
class Call:
    """Diagnostics only: `echo`, `fail` (the RPC path and its error path, in tests) and
    `logprobs` (the trainer's log-probs of given rows, for consistency checks). Every
    operation the coordinator relies on has a typed message of its own."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)
    method: str
    args: dict[str, Any] = field(default_factory=dict)


@_msg
class Shutdown:
    """Exit after answering `Done`."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)
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

    req_id: int = 0  # assigned by the link (WorkerLink.call)
    rank: int
    world_size: int
    init_method: str  # a torch.distributed rendezvous URL: "tcp://host:port", "file://..."


@_msg
class SetParticipants:
    """The next OptimizerStep reduces over the first `participants` cells."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)
    participants: int


@_msg
class SaveCheckpoint:
    """The trainer's state (parameters, optimizer, version) to `path` on the node."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)
    path: str


@_msg
class LoadCheckpoint:
    req_id: int = 0  # assigned by the link (WorkerLink.call)
    path: str


@_msg
class Stats:
    req_id: int = 0  # assigned by the link (WorkerLink.call)


@_msg
class OpenRelay:
    """A proxy listener inside process `pid`'s network namespace (a sandbox on this node's
    host) relaying to the coordinator's proxy on `proxy_port`."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)
    pid: int  # in this host's pid namespace
    proxy_port: int


@_msg
class CloseRelay:
    req_id: int = 0  # assigned by the link (WorkerLink.call)
    relay: int  # RelayOpened.relay


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

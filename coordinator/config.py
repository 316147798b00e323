"""config.py: `CoordinatorConfig`, the whole run's settings as one frozen dataclass.

Written to the run directory as resolved JSON at start. Derived values are properties.
Not a parser: the CLI builds it (flags and config files come later, in one place).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from gyre.coordinator.policies import POLICIES
from gyre.coordinator.schedule import dispatch_target
from gyre.proxy.admission import J_MAX
from gyre.proxy.serving import SERVING_FIELDS, ProxyConfig
from gyre.workerd.wire import ENGINE_BACKENDS, TRAINER_BACKENDS, EngineSpec, TrainerSpec

# (field, bound, strict): value > bound (strict) or >= bound; None passes (optional fields).
# The serving fields' rules are ProxyConfig's (proxy/serving.py), applied by `serving()`.
_RANGES = [
    ("steps", 1, False), ("mu", 1, False), ("groups_per_step", 1, False), ("group_size", 1, False),
    ("phi", 0, False), ("oversample", 0, False), ("cells", 1, False), ("async_training_cells", 0, False),
    ("exec_slots_per_cell", 1, False), ("engine_max_running", 1, False), ("execution_timeout_s", 0, True),
    ("eval_attempts", 1, False), ("eval_budget_s", 0, False), ("j_max", 1, False), ("micro_step_tokens", 1, False),
    ("lr", 0, True), ("topology_timeout_s", 0, True), ("checkpoint_every", 0, False), ("worker_timeout_s", 0, True),
    ("worker_linger_s", 0, False),
    ("worker_call_timeout_s", 0, True), ("checkpoint_timeout_s", 0, True), ("infra_failures_in_row", 0, False),
    # Training's own rule beside serving's (>= 0): a policy sampled at temperature 0 has no
    # distribution for the trainer to reproduce.
    ("rollout_temperature", 0, True),
    ("transfer_port", 0, False), ("route_balance_abs", 1, False),
    ("route_balance_rel", 1, False), ("prefix_cache_mb", 0, False), ("gc_freeze_every_s", 0, False),
    ("eval_every", 0, False), ("eval_k", 1, False), ("keep_checkpoints", 0, False),
]


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorConfig:
    run_dir: Path  # the run directory: config.json, metrics.jsonl, executions, checkpoints (the durable state)
    model_dir: Path  # the model directory (config.json, tokenizer, weights; gyre.json: gyre's per-model defaults)
    steps: int = 5  # optimizer steps to run (each consumes groups_per_step groups); the run ends after them
    # Placement policy (coordinator/policies.py): elastic | colocate | async | async-streaming;
    # elastic measured fastest of the three on the embedded default (docs/benchmarks.md)
    policy: str = "elastic"
    phi: float = 0.0  # boundary-dispatch lead, in batches
    mu: int = 1  # steps per burst (between weight publications)
    groups_per_step: int = 2  # B: groups (queries) one optimizer step consumes
    group_size: int = 8  # N executions per query
    oversample: int = 0  # k extra executions per group, cancelled once N are valid
    min_valid: int = 2  # valid outcomes a group needs to train
    cells: int = 2  # cells (workers, each an engine and a trainer) in the run; cell 0 is the core
    async_training_cells: int = 1  # async, async-streaming: cells [0, t) train, the rest roll out
    exec_slots_per_cell: int = 8  # concurrent executions one rollout cell serves
    engine_max_running: int = 64  # concurrent inference requests one cell's engine batches
    # Which engine serves a call (coordinator/routing.py): affine (each execution's calls go to
    # its home engine, whose prefix cache holds its history's KV) | least-inflight (the baseline)
    routing: str = "affine"
    # The load bound: an engine with more than max(min + abs, min x rel) executions homed (min:
    # the least-loaded accepting engine's) sheds its newest ones to the least loaded
    route_balance_abs: int = 2
    route_balance_rel: float = 1.5  # rel in the load bound above
    prefix_cache_mb: int = 512  # the CPU engine's cache of finished requests' KV, per cell; 0: off
    harness: str | tuple[str, ...] = "demo"  # a preset name (harnesses.py) or a command argv
    harnesses: dict = field(default_factory=dict)  # user presets: name -> fields (may `extends`)
    tasks_path: Path | None = None  # Harbor task folder(s), SWE-style or gyre JSONL; None: the embedded set
    # Where executions run (coordinator/sandbox/): process (a host folder, no isolation) |
    # podman | docker (a container per execution from the task's image, proxy-only network) |
    # bubblewrap (a light local sandbox, no image). Unset (no --sandbox, not in the file): gyre
    # up, tasks run, eval and serve pick podman, else docker, when a task runs in a container
    # image, else process; config.json records the one picked.
    sandbox: str = "process"
    # podman/docker: the engine's Docker-compatible endpoint; None: podman's own service, docker's socket
    sandbox_url: str | None = None
    infra_failure: str = "aborted_infra"  # a sandbox that fails: aborted_infra (invalid) | placeholder (a valid zero)
    # Stop the run when this many executions in a row ended aborted_infra (a broken sandbox, engine
    # or image would otherwise replace group after group forever); 0: never.
    infra_failures_in_row: int = 16
    keep_sandbox: str = "never"  # after an execution: never | on_failure | always (debugging)
    sandbox_internet: bool = False  # may tasks with allow_internet = true have it (podman/docker's default network)
    sandbox_cpus: float | None = None  # CPUs per sandbox where the task sets none; None: no limit
    sandbox_memory_mb: int | None = None  # memory per sandbox, MiB, where the task sets none; None: no limit
    sandbox_pids: int | None = 4096  # processes per sandbox (a fork bomb stops here)
    # Several sandbox hosts ([[sandbox_hosts]]: name, url, max_concurrent, node): executions spread
    # over them; `node` names the workerd making the proxy-only network on a host not this one.
    sandbox_hosts: tuple = ()
    swe_score: str = "all"  # SWE-style rows: all (1 when every test passes, else 0) | fraction (of FAIL_TO_PASS)
    # Seconds an execution's harness may run before it is stopped (and its workspace evaluated all the
    # same), unless the task or the harness preset sets its own timeout_s
    execution_timeout_s: float = 120.0
    eval_attempts: int = 3  # evaluation attempts per execution (a failed one is retried on the same workspace)
    # Seconds after the harness ends within which a retried evaluation may start (the first always runs);
    # every attempt failed: the execution is invalid, never scored 0
    eval_budget_s: float = 60.0
    j_max: int | None = J_MAX  # trajectories admitted per execution for training (proxy/admission.py); None: all
    micro_step_tokens: int = 8192  # per-rank token budget of one micro-step (tree: unique tokens; paths: rows x width)
    # How a micro-step carries trajectories (coordinator/packing.py): tree (each execution's
    # admitted paths as one tree, every shared token sent and computed once) | paths (one
    # padded row per path) | packed (one row per path, end to end, no padding)
    packing: str = "tree"
    # Seconds between gc.freeze() calls (coordinator/gcpolicy.py): the long-lived trees out of
    # the cycle collector's full passes (2.3 s pauses at 1,152 executions); 0: Python's own
    gc_freeze_every_s: float = 30.0
    lr: float | None = None  # learning rate; None: the model directory's gyre.json, else 1e-6 (a real model's)
    seed: int = 0  # the task order's shuffle, admission's draws, the engines' sampling, a tiny model's weights
    address: str = "tcp://127.0.0.1:0"  # ZeroMQ bind for workerds
    # local: spawn one workerd process per cell here; inproc: one worker thread per cell in this
    # process (no sockets: tests, a laptop); external: wait for `cells` workerds to register
    workers: str = "local"
    topology_timeout_s: float = 600.0  # external: how long to wait for every cell's worker
    # local: how long the workerds it spawned outlive a coordinator that died (a crash, a kill -9),
    # holding their model and trainer for `gyre up --resume` to take back; 0: they end with it
    worker_linger_s: float = 120.0
    reducer_init: str | None = None  # torch.distributed init for the gradient reducer; None: auto
    weight_transfer: str = "zmq"  # how weights reach other cells: zmq (via the link) | mooncake (pulled) | broadcast
    # Mooncake/broadcast: the address peers reach a node at; None: loopback or its host
    transfer_host: str | None = None
    transfer_port: int = 29510  # broadcast: the rendezvous port on the core's host (workers on other hosts)
    checkpoint_every: int = 5  # steps between checkpoints (at a publication); 0: never
    keep_checkpoints: int = 0  # the newest N complete checkpoints stay, older ones are deleted; 0: keep all
    worker_timeout_s: float = 10.0  # a worker silent this long is dead (heartbeats every 0.5 s)
    worker_call_timeout_s: float = 600.0  # seconds allowed a micro-step, optimizer step or other long worker call
    checkpoint_timeout_s: float = 3600.0  # seconds allowed saving or loading a checkpoint (weights + optimizer state)
    keys_dir: Path | None = None  # CURVE keys (gyre keys init): encrypted link, authorised workers only
    engine_backend: str = "cpu"  # the rollout engine of workerds this run spawns: cpu | sglang
    trainer_backend: str = "cpu"  # their trainer: cpu | megatron (external workerds pick their own flags)
    engine_options: dict = field(default_factory=dict)  # to every engine (sglang: server = {tp_size = 2, ...})
    # to every trainer (megatron: tp, pp, microbatches, offload; weight_decay)
    trainer_options: dict = field(default_factory=dict)
    proxy_host: str = "127.0.0.1"  # where the harnesses' HTTP proxy (the model API they call) listens
    proxy_port: int = 0  # its port; 0: a free one, chosen at start
    # Output limits per model call. None: the model directory's gyre.json, else the remaining
    # context (a real agent turn may be long; the context bounds it).
    default_max_tokens: int | None = None  # a request that sets no limit gets this
    max_tokens_cap: int | None = None  # a request asking more is cut to this
    max_context: int | None = None  # prompt + output tokens per call; None: the model's max_position_embeddings
    # Sampling for every call (a harness's own temperature / top_p are recorded, not used):
    # behaviour log-probs and the trainer's are of this one distribution.
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0  # top-p of every call; < 1 needs allow_rollout_top_p
    # Each execution's share of the proxy, so one cannot starve the rest (proxy/budget.py): at
    # most this many model calls in flight at once, shared while several executions call (n
    # calling: max(1, this // n) each; 0: unlimited; 4 leaves room for a harness's parallel
    # sub-agents; a neighbour's calls beside one keeping 32 in flight: docs/benchmarks.md) ...
    max_calls_in_flight_per_execution: int = 4
    # ... and this many tokens a minute, prefilled (new to its history) and generated (0:
    # unlimited; a bucket one minute deep, so a burst of that many is let through) ...
    max_tokens_per_minute_per_execution: int = 0
    # ... a call over either waits its turn at most this long, then is answered 429 in the
    # provider's shape with retry-after (harnesses retry it; the execution's Recorder counts
    # it as gyre's own refusal, never the agent's failure).
    budget_wait_s: float = 60.0
    allow_rollout_top_p: bool = False  # train on top-p-truncated samples, which the trainer cannot reproduce
    # A reward is valid only finite and within [low, high]; outside it the evaluation is an
    # evaluator_error, never trained (a 1e308 would overflow the group's advantages).
    reward_range: tuple = (-1e6, 1e6)
    # Experiment trackers the run's metrics also go to (coordinator/trackers.py): tensorboard, wandb
    trackers: tuple = ()
    tracker_options: dict = field(default_factory=dict)  # per tracker: {wandb = {project = ..., mode = ...}}
    # Held-out evaluation during training: every `eval_every` steps (0: never), pass@eval_k over
    # eval_tasks_path, run on rollout capacity, recorded as `eval` events and never trained.
    eval_every: int = 0
    eval_tasks_path: Path | None = None  # the held-out tasks (formats as tasks_path); needed when eval_every > 0
    eval_k: int = 1  # executions per held-out task each round: the k of pass@k
    # Bind the worker link (address) beyond loopback without keys_dir: any process that reaches it
    # can register as a worker and answer calls. Refused unless set; warned about at start.
    allow_unauthenticated_link: bool = False
    eval_pass_threshold: float = 1.0  # a held-out execution passes with a valid reward at least this

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name, low, strict in _RANGES:
            value = getattr(self, name)
            if value is not None and (value <= low if strict else value < low):
                raise ValueError(f"{name} must be {'>' if strict else '>='} {low}, got {value}")
        from gyre.coordinator.packing import PACKINGS
        from gyre.coordinator.routing import ROUTINGS

        if self.packing not in PACKINGS:
            raise ValueError(f"packing must be one of {', '.join(PACKINGS)}, got {self.packing!r}")

        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        self.serving()  # the serving fields, by the proxy's rules (one set, shared with `gyre serve`)
        if self.rollout_top_p < 1 and not self.allow_rollout_top_p:
            raise ValueError(f"rollout_top_p = {self.rollout_top_p} truncates the distribution the engines sample, "
                             "which the trainer cannot reproduce (its log-probs would not match the behaviour's); "
                             "set allow_rollout_top_p = true to train on it anyway")
        if not 1 <= self.min_valid <= self.group_size:
            raise ValueError(f"min_valid must be in [1, group_size={self.group_size}], got {self.min_valid}")
        self.preset()  # an unknown or unusable harness fails here, named
        from gyre.coordinator.launcher import INFRA_FAILURE, KEEP
        from gyre.coordinator.sandbox import BACKENDS
        from gyre.coordinator.verifier import SCORE_MODES

        for name, allowed in (("sandbox", BACKENDS), ("infra_failure", INFRA_FAILURE), ("keep_sandbox", KEEP),
                              ("swe_score", SCORE_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        from gyre.coordinator.sandbox.hosts import host_specs

        host_specs(self.sandbox_hosts)
        preset = self.preset()
        if preset.container_only and self.sandbox not in ("podman", "docker"):  # no host command to run
            raise ValueError(preset.missing(contained=False))
        if self.sandbox_hosts and self.sandbox not in ("podman", "docker"):
            raise ValueError(f"sandbox_hosts are Docker-compatible engines: set sandbox = \"podman\" or \"docker\" "
                             f"(sandbox is {self.sandbox!r})")
        for name in ("sandbox_cpus", "sandbox_memory_mb", "sandbox_pids"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.weight_transfer not in ("zmq", "mooncake", "broadcast"):
            raise ValueError(f"weight_transfer must be one of zmq, mooncake, broadcast, got {self.weight_transfer!r}")
        if self.workers not in ("local", "inproc", "external"):
            raise ValueError(f"workers must be one of local, inproc, external, got {self.workers!r}")
        if self.workers == "inproc" and self.keys_dir is not None:
            raise ValueError("workers = inproc has no link to encrypt: keys_dir is for workerds over ZeroMQ")
        if self.workers == "external" and self.address.rsplit(":", 1)[-1] == "0":
            raise ValueError(f"workers = external needs a fixed address for workerds to connect to, e.g. "
                             f"tcp://0.0.0.0:5555 (address is {self.address!r})")
        if self.engine_backend not in ENGINE_BACKENDS:
            raise ValueError(f"engine_backend must be one of {', '.join(ENGINE_BACKENDS)}, "
                             f"got {self.engine_backend!r}")
        if self.trainer_backend not in TRAINER_BACKENDS:
            raise ValueError(f"trainer_backend must be one of {', '.join(TRAINER_BACKENDS)}, "
                             f"got {self.trainer_backend!r}")
        rr = self.reward_range
        if len(rr) != 2 or not all(isinstance(x, int | float) for x in rr) or not rr[0] <= 0 <= rr[1] or rr[0] == rr[1]:
            raise ValueError(f"reward_range must be [low, high] with low <= 0 <= high and low < high (a placeholder's "
                             f"valid zero lies in it), got {list(self.reward_range)}")
        from gyre.coordinator.trackers import validate as validate_trackers

        validate_trackers(self.trackers, self.tracker_options)
        if self.eval_every and self.eval_tasks_path is None:
            raise ValueError("eval_every needs eval_tasks_path (the held-out tasks)")
        if POLICIES[self.policy].fixed_split and not 1 <= self.async_training_cells < self.cells:
            raise ValueError(f"{self.policy} needs 1 <= async_training_cells < cells ({self.cells}); "
                             f"got {self.async_training_cells}")
        for name, spec in (("engine_options", self.engine_spec), ("trainer_options", self.trainer_spec)):
            try:
                spec()
            except TypeError as e:  # a gyre option of the wrong type, named
                raise ValueError(f"{name}: {e}") from None
        from gyre.workerd.keys import on_loopback

        if self.keys_dir is None and not on_loopback(self.address) and not self.allow_unauthenticated_link:
            raise ValueError(f"address {self.address} is not on loopback and keys_dir is unset: any process that "
                             f"reaches it could pose as a worker; run `gyre keys init DIR` and set keys_dir = DIR, "
                             f"or set allow_unauthenticated_link = true to bind it without keys")

    def serving(self) -> ProxyConfig:
        """How the proxy serves this run's harnesses: the serving fields (proxy/serving.py
        SERVING_FIELDS) as one validated ProxyConfig; max_context unset (before
        runconfig.with_model_defaults resolves it for the model) is ProxyConfig's default."""
        values = {name: getattr(self, name) for name in SERVING_FIELDS}
        if values["max_context"] is None:
            del values["max_context"]
        return ProxyConfig.from_fields(values)

    def engine_spec(self) -> EngineSpec:
        """What each cell's engine is welcomed with: this run's settings, then engine_options
        (gyre's option names over them, the rest the backend's own options)."""
        return EngineSpec.from_options({"seed": self.seed, "max_running": self.engine_max_running,
                                        "prefix_cache_mb": self.prefix_cache_mb, **self.engine_options})

    def trainer_spec(self) -> TrainerSpec:
        """What each cell's trainer is welcomed with, as engine_spec; lr as resolved
        (runconfig.with_model_defaults), the wire's default while it is unset."""
        own = {"temperature": self.rollout_temperature, "micro_step_tokens": self.micro_step_tokens}
        if self.lr is not None:
            own["lr"] = self.lr
        return TrainerSpec.from_options({**own, **self.trainer_options})

    def preset(self):
        from gyre.coordinator.harnesses import resolve

        return resolve(self.harness, self.harnesses)

    @property
    def initial_groups(self) -> int:
        return dispatch_target(self.phi, self.mu, self.groups_per_step, 0)

    def dispatch_target(self, publications: int) -> int:
        """Cumulative groups dispatched after `publications` weight publications."""
        return dispatch_target(self.phi, self.mu, self.groups_per_step, publications)

    def to_json(self) -> dict:
        d = asdict(self)
        return {k: str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v for k, v in d.items()}

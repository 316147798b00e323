"""worker.py: `Worker`, the node's logic: it owns the rollout engine and the trainer.

Plain methods, one per wire command, each returning the replies to send; no sockets
(server.py owns those). Both backends live for the whole process: a role change releases
and restores memory, it never rebuilds an engine or a trainer.

    role      Generate      TrainMicroStep/OptimizerStep   SetRole(other)
    rollout   accepted      refused (RoleError)            abort running, release engine, onload trainer
    training  refused       accepted                       offload trainer, restore engine memory
"""

from __future__ import annotations

import enum
import logging
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gyre.workerd import wire
from gyre.workerd.config import WorkerConfig
from gyre.workerd.engines.base import SamplingParams
from gyre.workerd.tensors import from_frames, to_frame, to_frames

log = logging.getLogger("gyre.workerd")

Out = tuple[Any, list[wire.TensorFrame] | None]


class Role(enum.Enum):
    ROLLOUT = "rollout"
    TRAINING = "training"
    SWITCHING = "switching"


def kv_frames(cache) -> list[wire.TensorFrame]:
    n = cache.length
    frames = []
    for i, (k, v) in enumerate(zip(cache.k, cache.v)):
        frames += [to_frame(f"k.{i}", k[:, :n].contiguous()), to_frame(f"v.{i}", v[:, :n].contiguous())]
    return frames


def prompt_of(msg: wire.Generate, tensors: list[wire.TensorFrame]) -> tuple[list[int], list[wire.TensorFrame]]:
    """A Generate's prompt ids (from its "prompt" frame when it says so) and its other frames."""
    if not msg.prompt_in_frame:
        return msg.prompt_ids, tensors
    frame = next((f for f in tensors if f.name == wire.PROMPT_FRAME), None)
    if frame is None or frame.dtype not in ("uint16", "int32") or len(frame.shape) != 1:
        raise ValueError("Generate.prompt_in_frame without a 1-d uint16/int32 frame named 'prompt'")
    ids = np.frombuffer(frame.data, dtype=frame.dtype).tolist()
    return ids, [f for f in tensors if f.name != wire.PROMPT_FRAME]


def kv_from_frames(tensors: list[wire.TensorFrame], n: int):
    from gyre.workerd.model import SeqCache

    named = from_frames(tensors)
    layers = len(named) // 2
    cache = SeqCache()
    for i in range(layers):
        k, v = named[f"k.{i}"], named[f"v.{i}"]
        if k.shape[1] != n:
            raise ValueError(f"KV frame k.{i} covers {k.shape[1]} tokens, kv_tokens says {n}")
        cache.append(i, k.clone(), v.clone())
    cache.length = n
    return cache


class RoleError(RuntimeError):
    """A command that the worker's current role does not allow."""


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.node_id = config.resolved_node_id
        self.role = Role.SWITCHING  # until Welcome
        self.cell: int | None = config.cell
        self.engine = None
        self.trainer = None
        self.reducer = None
        self.should_exit = False
        self._streams: dict[str, int] = {}  # rid -> req_id of its Generate
        self._made: tuple | None = None  # (run, model_dir, engine spec, trainer spec) the backends were built for
        self._kept: tuple | None = None  # (_made, role) kept across a Reregister, for the next Welcome
        self._params = 0
        self.handlers: dict[type, Callable[[Any, list[wire.TensorFrame]], list[Out]]] = {
            wire.Welcome: self.welcome,
            wire.Generate: self.generate,
            wire.Abort: self.abort,
            wire.SetRole: self.set_role,
            wire.TrainMicroStep: self.train_micro_step,
            wire.OptimizerStep: self.optimizer_step,
            wire.ExportWeights: self.export_weights,
            wire.LoadWeights: self.load_weights,
            wire.Call: self.call,
            wire.Shutdown: self.shutdown,
            wire.Reregister: self.reset,
            wire.InitReducer: self.init_reducer,
            wire.SetParticipants: self.set_participants,
            wire.SaveCheckpoint: self.save_checkpoint,
            wire.LoadCheckpoint: self.load_checkpoint,
            wire.Stats: self.stats,
            wire.OpenRelay: self.open_relay,
            wire.CloseRelay: self.close_relay,
            wire.InitTransfer: self.init_transfer,
            wire.OfferWeights: self.offer_weights,
            wire.PullWeights: self.pull_weights,
            wire.InitBroadcast: self.init_broadcast,
            wire.WeightSpecs: self.weight_specs,
            wire.PrepareBroadcast: self.prepare_broadcast,
            wire.BroadcastWeights: self.broadcast_weights,
            wire.ReceiveWeights: self.receive_weights,
        }
        # Diagnostics only (wire.Call): every operation the coordinator relies on is typed.
        self.calls: dict[str, Callable[..., Any]] = {
            "echo": lambda **kw: kw,
            "fail": self._fail,
            "logprobs": self._logprobs,
        }
        self.relays = None  # sandboxes' proxy-only network on this node (relays.py), made on first use
        self.broadcast = None  # the weight-broadcast group (transfer.BroadcastGroup), when configured
        self._bcast_ready: tuple[int, dict] | None = None  # (version, tensors) the core will send
        self.transfer = None  # the weight-transfer backend (transfer.py), when not the ZeroMQ default

    # --- dispatch -----------------------------------------------------------------------

    def handle(self, msg: Any, tensors: list[wire.TensorFrame]) -> list[Out]:
        """Run the handler for `msg`; any exception becomes an `Error` reply, never a crash."""
        try:
            return self.handlers[type(msg)](msg, tensors)
        except Exception as e:  # noqa: BLE001 - reported to the caller, not swallowed
            log.warning("%s failed: %s", type(msg).__name__, e)
            return [(wire.Error(req_id=getattr(msg, "req_id", -1), kind=type(e).__name__,
                                message=str(e) or traceback.format_exc(limit=1)), None)]

    @property
    def busy(self) -> bool:
        return self.engine is not None and self.engine.running > 0

    def step(self) -> list[Out]:
        """Advance running rollout requests by one engine step; stream what they produced."""
        outs: list[Out] = []
        for o in self.engine.step():
            req_id = self._streams[o.rid]
            if o.finished:
                del self._streams[o.rid]
            outs.append((wire.GenerateChunk(
                req_id=req_id, rid=o.rid, token_ids=o.token_ids, logprobs=o.logprobs,
                version=o.version, finished=o.finished, finish_reason=o.finish_reason,
                prompt_tokens=o.prompt_tokens, cached_tokens=o.cached_tokens), None))
        return outs

    # --- lifecycle ----------------------------------------------------------------------

    def welcome(self, msg: wire.Welcome, _) -> list[Out]:
        from gyre.workerd.backends import build_backends

        t0 = time.perf_counter()
        self.cell = msg.cell
        made = (msg.run, msg.model_dir, msg.engine, msg.trainer)
        kept, self._kept = self._kept, None
        if kept is not None and msg.run and kept[0] == made and self.trainer.version == msg.version:
            # The same run welcomes us again at our trainer's version (its coordinator restarted):
            # the backends as they are, the role changed as SetRole does, nothing reloaded.
            self._to_role(kept[1], Role(msg.role))
            return [(wire.Ready(node_id=self.node_id, role=self.role.value, version=self.engine.version,
                                params=self._params, load_seconds=time.perf_counter() - t0, kept=True,
                                trainer_version=self.trainer.version), None)]
        if kept is not None:
            self._drop_backends()
        self.engine, self.trainer, self._params = build_backends(
            msg.model_dir, engine=self.config.engine_backend, trainer=self.config.trainer_backend,
            engine_spec=msg.engine, trainer_spec=msg.trainer,
        )
        self._made = made
        # build_backends leaves the engine released (built, then freed before the trainer is
        # built, so the two never hold the device together); a rollout cell takes it back.
        self.role = Role(msg.role)
        if self.role is Role.ROLLOUT:
            self.trainer.offload()
            self.engine.resume_memory()
        return [(wire.Ready(node_id=self.node_id, role=self.role.value, version=self.engine.version,
                            params=self._params, load_seconds=time.perf_counter() - t0,
                            trainer_version=self.trainer.version), None)]

    def _to_role(self, current: Role, target: Role) -> None:
        """Memory from `current`'s side to `target`'s (the order of set_role); nothing to hand on."""
        if target is not current:
            if target is Role.TRAINING:
                self.engine.release_memory()
                self.trainer.onload()
            else:
                self.trainer.offload()
                self.engine.resume_memory()
        self.role = target

    def kept_state(self) -> dict | None:
        """What a Register says it kept (wire.Register.kept), or None."""
        if self._kept is None:
            return None
        run = self._kept[0][0]
        return {"run": run, "cell": self.cell, "version": self.engine.version,
                "trainer_version": self.trainer.version}

    def reset(self, msg: wire.Reregister | None = None, _=None) -> list[Out]:
        """Back to the state before Welcome: the old coordinator's session is gone (its
        requests' streams with it), so nothing is answered; the server registers again. The
        backends are kept where the trainer can drop a step's gradients (the next Welcome
        takes them if it is the same run's at the trainer's version, else builds anew)."""
        for rid in list(self._streams):
            if self.engine is not None:
                self.engine.abort(rid)
        self._streams.clear()
        if self.reducer is not None:
            self.reducer.close()
            self.reducer = None
        if self.broadcast is not None:
            self.broadcast.close()
            self.broadcast = None
        self._bcast_ready = None
        if self._made is not None and self._made[0] and self.engine is not None and self.trainer is not None \
                and self.role is not Role.SWITCHING and self.trainer.drop_gradients():
            self._kept = (self._made, self.role)
        else:
            self._drop_backends()
        self.role = Role.SWITCHING
        return []

    def _drop_backends(self) -> None:
        if self.trainer is not None:
            self.trainer.close()  # a TP cell's rank processes
        if self.engine is not None:
            self.engine.shutdown()  # SGLang's scheduler processes hold the device
        self.engine = self.trainer = None
        self._made = self._kept = None

    def shutdown(self, msg: wire.Shutdown, _) -> list[Out]:
        self.should_exit = True
        return [(wire.Done(req_id=msg.req_id), None)]

    def abort_all(self, reason: str = "abort", handover: bool = False) -> list[Out]:
        """Abort every running request (role change, shutdown): their streams end now. With
        `handover`, each final chunk carries the request's KV so another engine can skip
        recomputing its prefill."""
        outs = []
        for rid, req_id in list(self._streams.items()):
            kv = self.engine.export_kv(rid) if handover else None
            o = self.engine.abort(rid)
            del self._streams[rid]
            if o is not None:
                frames = kv_frames(kv) if kv is not None else None
                outs.append((wire.GenerateChunk(req_id=req_id, rid=rid, token_ids=[], logprobs=[],
                             version=o.version, finished=True, finish_reason=reason,
                             prompt_tokens=o.prompt_tokens, kv_tokens=kv.length if kv else 0,
                             cached_tokens=o.cached_tokens), frames))
        return outs

    # --- rollout ------------------------------------------------------------------------

    def generate(self, msg: wire.Generate, tensors) -> list[Out]:
        if self.role is not Role.ROLLOUT:
            raise RoleError(f"node {self.node_id} is {self.role.value}, not rollout")
        params = SamplingParams(max_new_tokens=msg.max_new_tokens, temperature=msg.temperature,
                                top_p=msg.top_p, stop_token_ids=tuple(msg.stop_token_ids), seed=msg.seed)
        prompt_ids, tensors = prompt_of(msg, tensors or [])
        if msg.kv_tokens and tensors:
            self.engine.add_request(msg.rid, prompt_ids, params, kv=kv_from_frames(tensors, msg.kv_tokens))
        else:
            self.engine.add_request(msg.rid, prompt_ids, params)
        self._streams[msg.rid] = msg.req_id
        return []

    def abort(self, msg: wire.Abort, _) -> list[Out]:
        outs: list[Out] = []
        req_id = self._streams.pop(msg.rid, None)
        o = self.engine.abort(msg.rid)
        if o is not None and req_id is not None:
            outs.append((wire.GenerateChunk(req_id=req_id, rid=msg.rid, token_ids=[], logprobs=[],
                         version=o.version, finished=True, finish_reason="abort",
                         prompt_tokens=o.prompt_tokens, cached_tokens=o.cached_tokens), None))
        outs.append((wire.Aborted(req_id=msg.req_id, found=o is not None), None))
        return outs

    def set_role(self, msg: wire.SetRole, _) -> list[Out]:
        target = Role(msg.role)
        if target is Role.SWITCHING:
            raise ValueError("SetRole takes 'rollout' or 'training'")
        t0 = time.perf_counter()
        outs: list[Out] = []
        freed = 0
        if target is not self.role:
            self.role = Role.SWITCHING
            # Memory changes hands in this order on a GPU: the side giving it up frees first.
            if target is Role.TRAINING:
                outs += self.abort_all(handover=True)  # handed back with their KV, continued elsewhere
                freed = self.engine.release_memory()
                self.trainer.onload()
            else:
                freed = self.trainer.offload()
                self.engine.resume_memory()
            self.role = target
        outs.append((wire.RoleChanged(req_id=msg.req_id, role=target.value,
                                      seconds=time.perf_counter() - t0, freed_bytes=freed), None))
        return outs

    # --- training -----------------------------------------------------------------------

    def train_micro_step(self, msg: wire.TrainMicroStep, tensors) -> list[Out]:
        from gyre.workerd.trainers.base import MicroBatch

        trainer = self._need_trainer(training=True)
        named = from_frames(tensors)
        if wire.TREE_INPUT_IDS in named:  # the tree form: each unique token once
            from gyre.workerd.trainers.treebatch import from_wire

            batch = from_wire(named)
        else:
            batch = MicroBatch.from_tensors(named)
        s = trainer.train_micro_step(batch)
        return [(wire.TrainResult(req_id=msg.req_id, loss=s.loss, tokens=s.tokens, executions=s.executions,
                                  seconds=s.seconds, mismatch_kl=s.mismatch), None)]

    def optimizer_step(self, msg: wire.OptimizerStep, _) -> list[Out]:
        trainer = self._need_trainer(training=True)
        t0 = time.perf_counter()
        norm = trainer.optimizer_step(msg.num_executions, reducer=self.reducer, apply=msg.apply)
        return [(wire.StepResult(req_id=msg.req_id, version=trainer.version, grad_norm=norm,
                                 seconds=time.perf_counter() - t0), None)]

    def export_weights(self, msg: wire.ExportWeights, _) -> list[Out]:
        trainer = self._need_trainer()
        frames = to_frames(trainer.export_weights())
        nbytes = sum(f.data.nbytes for f in frames)
        return [(wire.Weights(req_id=msg.req_id, version=trainer.version, nbytes=nbytes), frames)]

    def load_weights(self, msg: wire.LoadWeights, tensors) -> list[Out]:
        """Tensors given: load them. None given: copy this node's own trainer (colocated),
        unless the weights are `unchanged` and the engine still holds them."""
        t0 = time.perf_counter()
        if msg.unchanged and not tensors and self.engine.holds(msg.version):
            return [(wire.Loaded(req_id=msg.req_id, version=msg.version,
                                 seconds=time.perf_counter() - t0, nbytes=0), None)]
        if tensors:
            named = from_frames(tensors)
        else:
            named = self._need_trainer().export_weights()
        nbytes = self._load_named(named, msg.version, engine=msg.engine, trainer=msg.trainer and bool(tensors))
        return [(wire.Loaded(req_id=msg.req_id, version=msg.version,
                             seconds=time.perf_counter() - t0, nbytes=nbytes), None)]

    # --- reduction, checkpoints, stats, relays -------------------------------------------

    def init_reducer(self, msg: wire.InitReducer, _) -> list[Out]:
        if self.reducer is not None:
            raise RuntimeError("reducer already initialised")
        # A TP cell: every rank joins its own world; any other trainer, this process alone.
        self.reducer = self._need_trainer().init_reducer(rank=msg.rank, world_size=msg.world_size,
                                                         init_method=msg.init_method)
        return [(wire.Done(req_id=msg.req_id), None)]

    def set_participants(self, msg: wire.SetParticipants, _) -> list[Out]:
        if self.reducer is None:
            raise RuntimeError("no reducer: InitReducer first")
        self.reducer.group_for(msg.participants)
        self.reducer.participants = msg.participants
        self._need_trainer().set_participants(msg.participants)
        return [(wire.Done(req_id=msg.req_id), None)]

    def save_checkpoint(self, msg: wire.SaveCheckpoint, _) -> list[Out]:
        self._need_trainer().save_checkpoint(msg.path)
        return [(wire.Done(req_id=msg.req_id), None)]

    def load_checkpoint(self, msg: wire.LoadCheckpoint, _) -> list[Out]:
        trainer = self._need_trainer()
        trainer.load_checkpoint(msg.path)
        return [(wire.CheckpointLoaded(req_id=msg.req_id, version=trainer.version), None)]

    def stats(self, msg: wire.Stats, _) -> list[Out]:
        import resource

        return [(wire.WorkerStats(
            req_id=msg.req_id, node_id=self.node_id, cell=self.cell, role=self.role.value,
            running=self.engine.running if self.engine else 0,
            version=self.engine.version if self.engine else -1,
            trainer_version=self.trainer.version if self.trainer else -1,
            # Linux reports ru_maxrss in KiB
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), None)]

    def open_relay(self, msg: wire.OpenRelay, _) -> list[Out]:
        got = self._relays().open(pid=msg.pid, proxy_port=msg.proxy_port)
        return [(wire.RelayOpened(req_id=msg.req_id, relay=got["relay"], port=got["port"]), None)]

    def close_relay(self, msg: wire.CloseRelay, _) -> list[Out]:
        got = self._relays().close(relay=msg.relay)
        return [(wire.RelayClosed(req_id=msg.req_id, closed=got["closed"]), None)]

    def _relays(self):
        if self.relays is None:
            from gyre.workerd.relays import RelayService

            self.relays = RelayService(self.config.coordinator)
        return self.relays

    # --- weight transfer: Mooncake (weight_transfer = "mooncake") --------------------------

    def init_transfer(self, msg: wire.InitTransfer, _) -> list[Out]:
        from gyre.workerd.transfer import MooncakeTransfer, TransferError

        if msg.backend != "mooncake":
            raise TransferError(f"unknown weight-transfer backend {msg.backend!r}")
        if self.transfer is None or self.transfer.host != msg.host:
            self.transfer = MooncakeTransfer(msg.host)
        return [(wire.TransferReady(req_id=msg.req_id, session=self.transfer.session), None)]

    def offer_weights(self, msg: wire.OfferWeights, _) -> list[Out]:
        """This node's trainer parameters, pullable by other nodes (cached per version)."""
        if self.transfer is None:
            raise RuntimeError("no weight-transfer backend: InitTransfer first")
        handle = self.transfer.offer(self._trainer_at(msg.version, "offer").export_weights(), msg.version)
        return [(wire.WeightOffer(req_id=msg.req_id, version=msg.version, nbytes=int(handle["nbytes"]),
                                  handle=handle), None)]

    def pull_weights(self, msg: wire.PullWeights, _) -> list[Out]:
        if self.transfer is None:
            raise RuntimeError("no weight-transfer backend: InitTransfer first")
        t0 = time.perf_counter()
        named, wire_seconds = self.transfer.pull(msg.handle)
        version = int(msg.handle["version"])
        self._load_named(named, version, engine=msg.engine, trainer=msg.trainer)
        return [(wire.WeightsReceived(req_id=msg.req_id, version=version, nbytes=int(msg.handle["nbytes"]),
                                      transfer_seconds=wire_seconds, seconds=time.perf_counter() - t0), None)]

    # --- weight transfer: broadcast (weight_transfer = "broadcast") -----------------------

    def init_broadcast(self, msg: wire.InitBroadcast, _) -> list[Out]:
        """Join the weight-broadcast group (blocks until every cell has joined); the core is
        rank 0. NCCL between GPU nodes, gloo otherwise."""
        from gyre.workerd.transfer import BroadcastGroup

        if self.broadcast is not None:
            raise RuntimeError("broadcast group already initialised")
        backend = "nccl" if self._bcast_device() == "cuda" else "gloo"
        self.broadcast = BroadcastGroup(master_address=msg.master_address, master_port=msg.master_port,
                                        rank=msg.rank, world_size=msg.world_size, group_name="gyre_publish",
                                        backend=backend, timeout_s=300)
        return [(wire.BroadcastJoined(req_id=msg.req_id, rank=msg.rank, backend=backend), None)]

    def _bcast_device(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def weight_specs(self, msg: wire.WeightSpecs, _) -> list[Out]:
        from gyre.workerd.transfer import BroadcastGroup

        specs = BroadcastGroup.specs(self._need_trainer().export_weights())
        return [(wire.TensorSpecs(req_id=msg.req_id, names=[n for n, _, _ in specs], dtypes=[d for _, d, _ in specs],
                                  shapes=[list(s) for _, _, s in specs]), None)]

    def prepare_broadcast(self, msg: wire.PrepareBroadcast, _) -> list[Out]:
        """The core, before any receiver enters the collective: export (and check) `version`."""
        if self.broadcast is None:
            raise RuntimeError("no broadcast group: InitBroadcast first")
        trainer = self._trainer_at(msg.version, "broadcast")
        if self._bcast_ready is None or self._bcast_ready[0] != msg.version:
            named = {k: v.to(self._bcast_device()) for k, v in trainer.export_weights().items()}
            self._bcast_ready = (msg.version, named)
        return [(wire.Done(req_id=msg.req_id), None)]

    def broadcast_weights(self, msg: wire.BroadcastWeights, _) -> list[Out]:
        """The core: send the prepared weights of `version` to every other member."""
        if self._bcast_ready is None or self._bcast_ready[0] != msg.version:
            raise RuntimeError(f"broadcast of version {msg.version} was not prepared")
        t0 = time.perf_counter()
        named, self._bcast_ready = self._bcast_ready[1], None  # sent once; not kept on the device
        nbytes = self.broadcast.send(named)
        return [(wire.WeightsSent(req_id=msg.req_id, version=msg.version, nbytes=nbytes,
                                  seconds=time.perf_counter() - t0), None)]

    def receive_weights(self, msg: wire.ReceiveWeights, _) -> list[Out]:
        if self.broadcast is None:
            raise RuntimeError("no broadcast group: InitBroadcast first")
        t0 = time.perf_counter()
        specs = [(n, d, tuple(s)) for n, d, s in zip(msg.names, msg.dtypes, msg.shapes, strict=True)]
        named = self.broadcast.recv(specs, device=self._bcast_device())
        wire_seconds = time.perf_counter() - t0
        nbytes = self._load_named(named, msg.version, engine=msg.engine, trainer=msg.trainer)
        return [(wire.WeightsReceived(req_id=msg.req_id, version=msg.version, nbytes=nbytes,
                                      transfer_seconds=wire_seconds, seconds=time.perf_counter() - t0), None)]

    def _load_named(self, named: dict[str, torch.Tensor], version: int, *, engine: bool, trainer: bool) -> int:
        """Received weights into this node's engine and/or trainer (every transfer path ends
        here); returns their bytes."""
        if engine:
            self.engine.load_weights(named.items(), version)
        if trainer:
            self._need_trainer().load_weights(named.items(), version)
        return sum(t.numel() * t.element_size() for t in named.values())

    def _trainer_at(self, version: int, what: str):
        trainer = self._need_trainer()
        if trainer.version != version:
            raise RuntimeError(f"{what} of version {version}, but the trainer is at {trainer.version}")
        return trainer

    def _need_trainer(self, training: bool = False):
        if self.trainer is None:
            raise RoleError(f"node {self.node_id} has no trainer yet (no Welcome)")
        if training and self.role is not Role.TRAINING:
            raise RoleError(f"node {self.node_id} is {self.role.value}, not training")
        return self.trainer

    # --- diagnostics (wire.Call) ---------------------------------------------------------

    def call(self, msg: wire.Call, _) -> list[Out]:
        fn = self.calls.get(msg.method)
        if fn is None:
            return [(wire.CallResult(req_id=msg.req_id, error=f"unknown method {msg.method!r} "
                                     f"(Call carries diagnostics only: {', '.join(self.calls)})"), None)]
        try:
            result = fn(**msg.args)
        except Exception as e:  # noqa: BLE001 - the caller gets the error text
            return [(wire.CallResult(req_id=msg.req_id, error=f"{type(e).__name__}: {e}"), None)]
        return [(wire.CallResult(req_id=msg.req_id, result=result), None)]

    def _logprobs(self, input_ids: list[list[int]]) -> list[list[float]]:
        """Trainer log-probs of given rows (for consistency checks and debugging)."""
        return self._need_trainer().current_logprobs(torch.tensor(input_ids)).tolist()

    @staticmethod
    def _fail(message: str = "requested failure") -> None:
        raise RuntimeError(message)

"""The typed protocol as a whole: every message is a wire type, every request has a typed
reply and a handler that answers with it, `Call` carries diagnostics only, and the
micro-step tensor names are spelled once (wire/steps.py) for both sides."""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

import pytest

from gyre.workerd import wire

ROOT = Path(__file__).resolve().parents[2]
DIAGNOSTICS = {"echo", "fail", "logprobs"}
NOT_REQUESTS = {wire.Welcome, wire.Generate, wire.Reregister}  # answered by Ready, a stream, a Register


def _worker(**kw):
    from gyre.workerd.config import WorkerConfig
    from gyre.workerd.worker import Worker

    return Worker(WorkerConfig(coordinator="ipc://unused", **kw))


def test_every_message_class_is_a_wire_type():
    """A message class added to wire/ (re-exported or not) but not to WIRE_TYPES would not
    decode; the parametrised round trip in test_wire.py covers exactly WIRE_TYPES. The
    option specs are fields of Welcome (its round trip carries them), never sent alone."""
    from gyre.workerd.wire import messages, weights

    classes = {obj for mod in (wire, messages, weights) for obj in vars(mod).values()
               if isinstance(obj, type) and dataclasses.is_dataclass(obj)}
    assert set(wire.OPTION_SPECS) <= classes and not set(wire.OPTION_SPECS) & set(wire.WIRE_TYPES.values())
    messages = classes - set(wire.OPTION_SPECS)
    assert messages == set(wire.WIRE_TYPES.values())
    assert len(wire.WIRE_TYPES) == len(messages)  # no two classes share a name


def test_every_request_has_one_typed_reply():
    assert set(wire.WORKER_COMMANDS) - set(wire.REPLIES) == NOT_REQUESTS
    assert set(wire.REPLIES) <= set(wire.WORKER_COMMANDS)
    for command, reply in wire.REPLIES.items():
        assert reply in wire.WIRE_TYPES.values() and reply not in wire.WORKER_COMMANDS, command
        for cls in (command, reply):
            assert "req_id" in {f.name for f in dataclasses.fields(cls)}, cls


def test_call_carries_only_diagnostics():
    """Every operation the coordinator relies on is typed: the worker's generic methods are
    the diagnostics, and no coordinator module builds a `Call`."""
    from gyre.coordinator.main import Coordinator

    assert set(_worker().calls) == DIAGNOSTICS
    assert not hasattr(Coordinator, "_call")
    offenders = [str(p.relative_to(ROOT)) for folder in ("coordinator", "proxy") for p in (ROOT / folder).rglob("*.py")
                 if re.search(r"\bCall\(|\._call\(", p.read_text())]
    assert offenders == []


def test_coordinator_imports_only_wire_from_workerd_in_the_link():
    """The link speaks the wire; its one other workerd import is the CURVE key files it binds
    with (workerd/keys.py, shared with the daemon's server.py). The whole coordinator's rule
    is tests/test_layering.py's."""
    text = (ROOT / "coordinator" / "link.py").read_text()
    assert set(re.findall(r"from gyre\.workerd(\.\w+)? import (\w+)", text)) == {
        ("", "wire"), (".keys", "on_loopback"), (".keys", "server_keys")}


def test_every_backend_keeps_its_interface():
    """The worker calls the optional capabilities (export_kv, shutdown; init_reducer,
    set_participants, close) on any backend: each backend subclasses its interface, which
    gives them defaults, and leaves no contract method unimplemented."""
    from gyre.workerd.engines.base import RolloutEngine
    from gyre.workerd.engines.cpu import CpuEngine
    from gyre.workerd.engines.sglang import SglangEngine
    from gyre.workerd.trainers.base import Trainer
    from gyre.workerd.trainers.cpu import CpuTrainer
    from gyre.workerd.trainers.megatron import MegatronTrainer
    from gyre.workerd.trainers.tp import TensorParallelTrainer

    for base, backends in ((RolloutEngine, (CpuEngine, SglangEngine)),
                           (Trainer, (CpuTrainer, MegatronTrainer, TensorParallelTrainer))):
        for cls in backends:
            assert issubclass(cls, base) and not cls.__abstractmethods__, cls
    assert SglangEngine.export_kv is RolloutEngine.export_kv  # no KV hand-over: recomputed elsewhere
    assert CpuTrainer.init_reducer is Trainer.init_reducer  # one GradReducer in this process
    worker_text = (ROOT / "workerd" / "worker.py").read_text()
    assert "hasattr(" not in worker_text


def test_micro_step_tensor_names_are_spelled_once():
    from gyre.coordinator.packing import MicroStep, Row
    from gyre.workerd.tensors import from_frames
    from gyre.workerd.trainers.base import MicroBatch

    assert [f.name for f in dataclasses.fields(MicroBatch)] == list(wire.MICRO_STEP_TENSORS)
    row = Row(ids=[1, 2, 3], mask=[False, True, True], logprobs=[0.0, -1.0, -2.0], versions=[0, 0, 0],
              advantage=0.5, loss_weight=0.5, exec_index=4)
    frames = MicroStep([row]).frames()
    assert [(f.name, f.dtype) for f in frames] == list(wire.MICRO_STEP_TENSORS.items())
    batch = MicroBatch.from_tensors(from_frames(frames))
    assert batch.exec_ids.tolist() == [[4, 4, 4]] and batch.advantages.tolist() == [[0.0, 0.5, 0.5]]
    with pytest.raises(ValueError, match=f"lacks tensors: {wire.EXEC_IDS}"):
        MicroBatch.from_tensors({k: v for k, v in from_frames(frames).items() if k != wire.EXEC_IDS})


def test_typed_commands_answer_with_their_reply_types(tiny_dir, tmp_path):
    """In process, no sockets: each command's handler answers with `wire.REPLIES[type]`
    (echoing req_id), or with an `Error` naming the exception, never a crash."""
    worker = _worker(node_id="n0")
    ids = itertools.count(1)

    def reply_to(cls, **fields):
        msg = cls(req_id=next(ids), **fields)
        replies = [m for m, _ in worker.handle(msg, []) if m.req_id == msg.req_id]
        assert len(replies) == 1, replies
        return replies[0]

    ckpt = str(tmp_path / "ckpt" / "trainer.pt")
    err = reply_to(wire.SaveCheckpoint, path=ckpt)  # before Welcome: no trainer
    assert isinstance(err, wire.Error) and err.kind == "RoleError" and "no trainer yet" in err.message
    before = reply_to(wire.Stats)
    assert (before.role, before.version, before.trainer_version) == ("switching", -1, -1)

    worker.handle(wire.Welcome(req_id=next(ids), node_id="n0", cell=0, role="training", model_dir=str(tiny_dir)), [])
    try:
        commands = [
            (wire.Stats, {}),
            (wire.InitReducer, {"rank": 0, "world_size": 1, "init_method": f"file://{tmp_path}/rendezvous"}),
            (wire.SetParticipants, {"participants": 1}),
            (wire.SaveCheckpoint, {"path": ckpt}),
            (wire.LoadCheckpoint, {"path": ckpt}),
            (wire.WeightSpecs, {}),
            (wire.CloseRelay, {"relay": 7}),
        ]
        got = {}
        for cls, fields in commands:
            reply = reply_to(cls, **fields)
            assert type(reply) is wire.REPLIES[cls], reply
            got[cls] = reply
        assert got[wire.Stats].role == "training" and got[wire.Stats].cell == 0 and got[wire.Stats].version == 0
        assert got[wire.LoadCheckpoint].version == 0
        assert got[wire.CloseRelay].closed is False  # no such relay
        specs = got[wire.WeightSpecs]
        exported = worker.trainer.export_weights()
        assert specs.names == list(exported) and len(specs.dtypes) == len(specs.shapes) == len(exported)
        assert specs.shapes[0] == list(exported[specs.names[0]].shape) and specs.dtypes[0] == "float32"

        # Failures are Error replies that name the exception; the worker serves on.
        for cls, fields, kind, needle in [
            (wire.InitReducer, {"rank": 0, "world_size": 1, "init_method": "file:///unused"}, "RuntimeError",
             "already initialised"),
            (wire.SetParticipants, {"participants": 2}, "ValueError", "participants must be in [1, 1]"),
            (wire.LoadCheckpoint, {"path": str(tmp_path / "none.pt")}, "FileNotFoundError", "none.pt"),
            (wire.InitTransfer, {"backend": "rdma", "host": "127.0.0.1"}, "TransferError", "'rdma'"),
            (wire.OfferWeights, {"version": 0}, "RuntimeError", "InitTransfer first"),
            (wire.PrepareBroadcast, {"version": 0}, "RuntimeError", "InitBroadcast first"),
            (wire.BroadcastWeights, {"version": 3}, "RuntimeError", "version 3 was not prepared"),
            (wire.ReceiveWeights, {"version": 1, "names": [], "dtypes": [], "shapes": [], "engine": True,
                                   "trainer": True}, "RuntimeError", "InitBroadcast first"),
        ]:
            err = reply_to(cls, **fields)
            assert isinstance(err, wire.Error) and err.kind == kind and needle in err.message, (cls, err)
        assert isinstance(reply_to(wire.Shutdown), wire.Done) and worker.should_exit
    finally:
        worker.reset()

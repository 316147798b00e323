"""The wire protocol: every type round-trips, bad frames are errors, no torch import."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing

import numpy as np
import pytest

from gyre.workerd import wire

SAMPLES = {int: 7, float: 0.5, str: "x", bool: True}


def _sample(tp):
    if dataclasses.is_dataclass(tp):  # Welcome's option specs, each field set
        return _instance(tp)
    origin = typing.get_origin(tp)
    union = getattr(__import__("types"), "UnionType", None)
    if origin is typing.Union or str(tp).startswith("int | None") or origin is union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _sample(args[0])
    if origin is list:
        return [_sample(typing.get_args(tp)[0])] * 2
    if origin is dict:
        return {"k": 1, "nested": [1, 2]}
    if tp is typing.Any:
        return {"any": [1, "two"]}
    return SAMPLES[tp]


def _instance(cls):
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _sample(hints[f.name]) for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("cls", list(wire.WIRE_TYPES.values()), ids=lambda c: c.__name__)
def test_every_type_round_trips(cls):
    msg = _instance(cls)
    decoded, tensors = wire.decode(wire.encode(msg))
    assert decoded == msg and type(decoded) is cls and tensors == []


def test_welcome_options_round_trip_as_typed_specs():
    """A Welcome's engine and trainer options are the wire's specs on both sides: gyre's
    options typed, the backend's own passed through; decoding rebuilds them from the JSON."""
    engine = wire.EngineSpec(seed=5, threads=2, options={"server": {"tp_size": 2, "dtype": "bfloat16"}})
    trainer = wire.TrainerSpec.from_options({"lr": 1, "checkpoint_layers": True, "tp": 2, "offload": False})
    assert trainer == wire.TrainerSpec(lr=1.0, checkpoint_layers=True, options={"tp": 2, "offload": False})
    assert type(trainer.lr) is float  # an int given for a float is one
    msg = wire.Welcome(req_id=1, node_id="n", cell=1, role="training", model_dir="/m", engine=engine, trainer=trainer)
    decoded, _ = wire.decode(wire.encode(msg))
    assert decoded == msg and type(decoded.engine) is wire.EngineSpec and type(decoded.trainer) is wire.TrainerSpec
    bare, _ = wire.decode(wire.encode(wire.Welcome(req_id=2, node_id="n", cell=0, role="rollout", model_dir="/m")))
    assert (bare.engine, bare.trainer) == (wire.EngineSpec(), wire.TrainerSpec())


@pytest.mark.parametrize("payload, match", [
    ({"engine": {"server": {}}}, "unexpected keyword argument 'server'"),  # a backend option is under options
    ({"trainer": {"lr": "1e-5"}}, "TrainerSpec.lr must be float, not '1e-5'"),
    ({"engine": {"max_running": True}}, "EngineSpec.max_running must be int"),
    ({"engine": {"seed": None}}, "EngineSpec.seed must be int, not None"),
    ({"trainer": {"options": []}}, "TrainerSpec.options must be dict"),
    ({"trainer": [1]}, "Welcome.trainer must be a TrainerSpec, not list"),
])
def test_bad_welcome_options_are_wire_errors(payload, match):
    import orjson

    body = {"req_id": 1, "node_id": "n", "cell": 0, "role": "rollout", "model_dir": "/m", **payload}
    with pytest.raises(wire.WireError, match=match):
        wire.decode([b"Welcome", orjson.dumps(body)])


def test_tensor_frames_round_trip():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    frames = wire.encode(wire.Weights(req_id=1, version=2, nbytes=a.nbytes),
                         [wire.TensorFrame("w", "float32", (3, 4), a)])
    msg, tensors = wire.decode([bytes(memoryview(f)) for f in frames])
    assert msg.version == 2
    (t,) = tensors
    assert t.name == "w" and t.shape == (3, 4)
    assert np.array_equal(np.frombuffer(t.data, dtype=np.float32).reshape(3, 4), a)


def test_messages_are_frozen_keyword_only():
    msg = wire.Abort(req_id=1, rid="r")
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.rid = "other"
    with pytest.raises(TypeError):
        wire.Abort(1, "r")


@pytest.mark.parametrize("frames, match", [
    ([b"NoSuchKind", b"{}"], "unknown message kind"),
    ([b"Abort", b"not json"], "bad Abort payload"),
    ([b"Abort", b'{"req_id": 1}'], "bad Abort payload"),
    ([b"Abort", b'{"req_id": 1, "rid": "r", "extra": 2}'], "bad Abort payload"),
    ([b"Abort"], "at least 2 frames"),
    ([b"Weights", b'{"req_id":1,"version":1,"nbytes":0}', b'[["a","float32",[1]]]'], "names 1 buffers, 0 sent"),
])
def test_bad_frames_raise_wire_error(frames, match):
    with pytest.raises(wire.WireError, match=match):
        wire.decode(frames)


def test_req_id_of_garbage():
    assert wire.req_id_of([b"X", b'{"req_id": 5}']) == 5
    assert wire.req_id_of([b"X", b"\xff"]) is None


def test_importing_wire_does_not_import_torch():
    code = ("import sys, gyre.workerd.wire; "
            "bad = [m for m in ('torch', 'sglang', 'megatron', 'numpy') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_worker_command_has_a_handler():
    from gyre.workerd.config import WorkerConfig
    from gyre.workerd.worker import Worker

    handlers = Worker(WorkerConfig(coordinator="ipc://unused")).handlers
    assert set(wire.WORKER_COMMANDS) == set(handlers)

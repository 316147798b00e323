"""A Generate's prompt travels as one raw frame of ids (the coordinator's loop never builds a
list of a long prompt's ints) and the worker runs it exactly as the same prompt sent as a list."""

from __future__ import annotations

import numpy as np
import pytest

from gyre.coordinator.routing import prompt_frame
from gyre.workerd import wire
from gyre.workerd.config import WorkerConfig
from gyre.workerd.engines.cpu import CpuEngine
from gyre.workerd.worker import Role, Worker, prompt_of


def run(worker: Worker, msg: wire.Generate, frames) -> list[int]:
    worker.generate(msg, frames)
    ids = []
    while worker.busy:
        ids += [t for m, _ in worker.step() for t in m.token_ids]
    return ids


def test_a_prompt_in_a_frame_generates_as_the_list(tiny_model):
    worker = Worker(WorkerConfig(coordinator="tcp://127.0.0.1:1", node_id="n0"))
    worker.engine, worker.role = CpuEngine(tiny_model), Role.ROLLOUT
    prompt = list(b"<|im_start|>user\nsay hello<|im_end|>\n")
    produced = list(b"hel")  # a handed-back request resumes after what it produced
    as_list = run(worker, wire.Generate(req_id=1, rid="a", prompt_ids=prompt + produced, max_new_tokens=8,
                                        temperature=0), [])
    frame = prompt_frame(np.asarray(prompt, dtype=np.uint16), produced)
    assert frame.dtype == "uint16" and frame.shape == (len(prompt) + len(produced),)
    as_frame = run(worker, wire.Generate(req_id=2, rid="b", prompt_ids=[], prompt_in_frame=True, max_new_tokens=8,
                                         temperature=0), [frame])
    assert as_frame == as_list and len(as_list) > 0


def test_the_prompt_frame_is_told_apart_from_handed_over_kv():
    kv = wire.TensorFrame("k.0", "float32", (1, 3, 2), np.zeros((1, 3, 2), np.float32))
    msg = wire.Generate(req_id=1, rid="a", prompt_ids=[], prompt_in_frame=True, max_new_tokens=1, kv_tokens=3)
    ids, rest = prompt_of(msg, [prompt_frame([5, 6, 70000], []), kv])
    assert ids == [5, 6, 70000] and rest == [kv]  # a list of Python ints becomes int32
    with pytest.raises(ValueError, match="frame named 'prompt'"):
        prompt_of(msg, [kv])

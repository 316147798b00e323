"""The coordinator's link when a worker is slow or fails: a call with no reply within its
bound, an Error reply, or a reply of the wrong type fails with one line naming the cell and
the command, never a bare TimeoutError or a silent None."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from gyre.coordinator.link import WorkerCallTimeout, WorkerError, WorkerLink
from gyre.workerd import wire


async def silent_worker(link: WorkerLink, node: str) -> zmq.asyncio.Socket:
    """A DEALER that registers with the link and then answers nothing."""
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, node.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(link.address)
    registered = asyncio.Event()
    link.on_event = lambda msg: registered.set() if isinstance(msg, wire.Register) else None
    await sock.send_multipart(wire.encode(wire.Register(req_id=1, node_id=node, cell=3, node_rank=0, host="h",
                                                        pid=1, devices=["cpu"], backends={})))
    await asyncio.wait_for(registered.wait(), 30)
    return sock


async def test_a_call_without_a_reply_names_the_cell_and_the_command():
    link = WorkerLink("tcp://127.0.0.1:0", call_timeout_s=0.3)
    await link.start()
    reader = asyncio.create_task(link.serve())
    link.describe = lambda node: f"cell 3 ({node})"
    sock = await silent_worker(link, "w3")
    try:
        with pytest.raises(WorkerCallTimeout) as e:
            await link.call("w3", wire.TrainMicroStep(req_id=link.new_req_id(), step=1))
        assert str(e.value) == "cell 3 (w3) did not answer TrainMicroStep within 0.3 s (worker_call_timeout_s)"
        with pytest.raises(WorkerCallTimeout) as e:  # a bound of the caller's own (checkpoint_timeout_s)
            await link.request("w3", wire.SaveCheckpoint(req_id=link.new_req_id(), path="x"), timeout=0.1)
        assert str(e.value) == "cell 3 (w3) did not answer SaveCheckpoint within 0.1 s"
        with pytest.raises(WorkerCallTimeout, match=r"did not answer Call echo within 0.1 s$"):
            await link.call("w3", wire.Call(req_id=link.new_req_id(), method="echo"), timeout=0.1)
        assert not link._pending  # nothing left waiting for the reply that never came
    finally:
        sock.close()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        link.close()


async def test_an_error_or_a_wrong_reply_names_the_command_and_the_cell():
    link = WorkerLink("tcp://127.0.0.1:0")
    await link.start()
    reader = asyncio.create_task(link.serve())
    link.describe = lambda node: f"cell 3 ({node})"
    sock = await silent_worker(link, "w3")

    async def answer(make):  # the worker's side: one reply to the next command
        frames = await sock.recv_multipart()
        msg, _ = wire.decode(frames)
        await sock.send_multipart(wire.encode(make(msg.req_id)))

    try:
        replies = [lambda r: wire.Error(req_id=r, kind="RoleError", message="no trainer yet"),
                   lambda r: wire.Loaded(req_id=r, version=1, seconds=0.0, nbytes=0),
                   lambda r: wire.CheckpointLoaded(req_id=r, version=4)]
        expected = ["SaveCheckpoint on cell 3 (w3) failed: RoleError: no trainer yet",
                    "SaveCheckpoint on cell 3 (w3) failed: WireError: answered Loaded, not Done"]
        for make, text in zip(replies, expected):
            task = asyncio.create_task(answer(make))
            with pytest.raises(WorkerError) as e:
                await link.request("w3", wire.SaveCheckpoint(req_id=link.new_req_id(), path="x"), timeout=10)
            await task
            assert str(e.value) == text
        task = asyncio.create_task(answer(replies[2]))
        got = await link.request("w3", wire.LoadCheckpoint(req_id=link.new_req_id(), path="x"), timeout=10)
        await task
        assert isinstance(got, wire.CheckpointLoaded) and got.version == 4
    finally:
        sock.close()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        link.close()


def test_the_run_config_bounds_worker_calls(tmp_path, tiny_dir):
    from gyre.coordinator.config import CoordinatorConfig
    from gyre.coordinator.local import LocalCluster

    c = CoordinatorConfig(run_dir=tmp_path, model_dir=tiny_dir, worker_call_timeout_s=42.0)
    cluster = LocalCluster(tiny_dir, cells=1, call_timeout_s=c.worker_call_timeout_s)
    assert cluster.link.call_timeout_s == 42.0
    assert cluster.link.describe("nobody") == "node nobody"
    cluster.link.close()
    with pytest.raises(ValueError, match="worker_call_timeout_s must be > 0"):
        CoordinatorConfig(run_dir=tmp_path, model_dir=tiny_dir, worker_call_timeout_s=0)

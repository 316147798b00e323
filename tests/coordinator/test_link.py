"""The coordinator's link when a worker is slow: a call with no reply within its bound fails
with one line naming the cell and the command, never a bare TimeoutError."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from gyre.coordinator.link import WorkerCallTimeout, WorkerLink
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
        with pytest.raises(WorkerCallTimeout, match=r"Call save_checkpoint within 0.1 s"):
            await link.call("w3", wire.Call(req_id=link.new_req_id(), method="save_checkpoint", args={}), timeout=0.1)
        assert not link._pending  # nothing left waiting for the reply that never came
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

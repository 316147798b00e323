"""The coordinator's link when a worker is slow or fails: a call with no reply within its
bound, an Error reply, or a reply of the wrong type fails with one line naming the cell and
the command, never a bare TimeoutError or a silent None. And when another process talks on
the worker port without keys: a reply counts only from the connection the request went to,
a connection speaks only for itself, an unregistered one is dropped unread, and a link
beyond loopback needs keys (or says it has none)."""

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
            await link.call("w3", wire.TrainMicroStep(step=1))
        assert str(e.value) == "cell 3 (w3) did not answer TrainMicroStep within 0.3 s (worker_call_timeout_s)"
        with pytest.raises(WorkerCallTimeout) as e:  # a bound of the caller's own (checkpoint_timeout_s)
            await link.request("w3", wire.SaveCheckpoint(path="x"), timeout=0.1)
        assert str(e.value) == "cell 3 (w3) did not answer SaveCheckpoint within 0.1 s"
        with pytest.raises(WorkerCallTimeout, match=r"did not answer Call echo within 0.1 s$"):
            await link.call("w3", wire.Call(method="echo"), timeout=0.1)
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
                await link.request("w3", wire.SaveCheckpoint(path="x"), timeout=10)
            await task
            assert str(e.value) == text
        task = asyncio.create_task(answer(replies[2]))
        got = await link.request("w3", wire.LoadCheckpoint(path="x"), timeout=10)
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


def _dealer(link: WorkerLink, identity: bytes | None) -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(link.address)
    return sock


def _beat(node: str) -> list[bytes]:
    return wire.encode(wire.Heartbeat(node_id=node, role="rollout", running=0, version=0, t=0.0))


class Beats:
    """Heartbeats seen by node: a peer's messages are read in order, so its heartbeat after
    a message says that message has been handled (no waiting on the clock)."""

    def __init__(self, link: WorkerLink):
        self.seen: dict[str, asyncio.Event] = {}
        self.events: list = []
        link.on_event = self.on_event

    def on_event(self, msg) -> None:
        self.events.append(msg)
        if isinstance(msg, wire.Heartbeat):
            self.seen.setdefault(msg.node_id, asyncio.Event()).set()

    async def after(self, sock, node: str) -> None:
        self.seen.setdefault(node, asyncio.Event()).clear()
        await sock.send_multipart(_beat(node))
        await asyncio.wait_for(self.seen[node].wait(), 30)


async def test_a_reply_counts_only_from_the_connection_the_request_went_to():
    link = WorkerLink("tcp://127.0.0.1:0")
    await link.start()
    reader = asyncio.create_task(link.serve())
    w3 = await silent_worker(link, "w3")
    w4 = await silent_worker(link, "w4")  # registered too, but the request went to w3
    beats = Beats(link)
    intruder = _dealer(link, b"intruder")  # never registered
    try:
        # 1) A call: forged answers from an unregistered connection and from another worker.
        call = asyncio.create_task(link.request("w3", wire.Call(method="echo"), timeout=30))
        cmd, _ = wire.decode(await w3.recv_multipart())
        forged = wire.encode(wire.CallResult(req_id=cmd.req_id, result="forged"))
        for sock, name in ((intruder, "intruder"), (w4, "w4")):
            await sock.send_multipart(forged)
            await beats.after(sock, name)
        assert not call.done()  # neither resolved it
        await w3.send_multipart(wire.encode(wire.CallResult(req_id=cmd.req_id, result="real")))
        assert (await call).result == "real"
        # 2) A stream: a forged finished chunk ends nothing; the real ones arrive, in order.
        gen = link.generate("w3", wire.Generate(rid="r", prompt_ids=[1], max_new_tokens=2))
        first = asyncio.ensure_future(anext(gen))
        cmd, _ = wire.decode(await w3.recv_multipart())

        def chunk(tokens, logprob, finished):
            return wire.encode(wire.GenerateChunk(req_id=cmd.req_id, rid="r", token_ids=tokens, logprobs=[logprob],
                                                  version=0, finished=finished))
        for sock, name in ((intruder, "intruder"), (w4, "w4")):
            await sock.send_multipart(chunk([7], -0.01, True))
            await beats.after(sock, name)
        assert not first.done()
        await w3.send_multipart(chunk([5], -1.5, False))
        await w3.send_multipart(chunk([6], -2.5, True))
        got = [await first] + [c async for c in gen]
        assert [(c.token_ids, c.logprobs) for c in got] == [([5], [-1.5]), ([6], [-2.5])]
        assert link.dropped == {"not a registered worker": 2, "a reply to a request sent to another node": 2}
        assert "intruder" not in link.nodes and not link._pending
    finally:
        for sock in (w3, w4, intruder):
            sock.close()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        link.close()


async def test_a_connection_speaks_only_for_itself_and_unregistered_ones_are_not_read(monkeypatch):
    link = WorkerLink("tcp://127.0.0.1:0")
    await link.start()
    reader = asyncio.create_task(link.serve())
    w3 = await silent_worker(link, "w3")
    beats = Beats(link)
    decoded: list[bytes] = []
    decode = wire.decode
    monkeypatch.setattr(wire, "decode", lambda frames: (decoded.append(bytes(frames[0])), decode(frames))[1])
    intruder = _dealer(link, b"intruder")
    nameless = [_dealer(link, None), _dealer(link, b"\xffnot utf-8")]  # ZeroMQ's own id; an undecodable one
    try:
        # 1) Lifecycle messages naming w3, from another connection: a Register would re-welcome
        #    it, a Deregister kill it. Neither reaches the cluster; w3 stays as it was.
        reg = wire.Register(req_id=1, node_id="w3", cell=0, node_rank=0, host="h", pid=1, devices=[], backends={})
        for msg in (reg, wire.Deregister(node_id="w3", reason="forged")):
            await intruder.send_multipart(wire.encode(msg))
        # 2) Heavy garbage from a connection that never registered: dropped on its kind frame.
        await intruder.send_multipart([b"GenerateChunk", b"\xff" * (1 << 20)])
        await intruder.send_multipart([b"Register", b"{" * (1 << 20)])  # too large to be a Register
        await beats.after(intruder, "intruder")
        assert [type(e) for e in beats.events] == [wire.Heartbeat]  # the intruder's own heartbeat only
        assert decoded == [b"Register", b"Heartbeat"]  # the small forged Register, read and refused; the heartbeat
        assert link.nodes["w3"].alive and list(link.nodes) == ["w3"]  # nothing kept for the intruder
        # 3) Connections whose routing id is not text: dropped, and the reader lives on.
        for sock in nameless:
            await sock.send_multipart(_beat("x"))
        call = asyncio.create_task(link.request("w3", wire.Call(method="echo"), timeout=30))
        cmd, _ = wire.decode(await w3.recv_multipart())
        await w3.send_multipart(wire.encode(wire.CallResult(req_id=cmd.req_id, result="real")))
        assert (await call).result == "real" and not reader.done()
        # ZeroMQ's own ids are b"\0" + a counter that starts at random: sometimes valid UTF-8. One
        # such id is dropped unread like the rest (it was decoded, then counted as a heartbeat
        # naming another node, whenever the counter's bytes were all below 0x80).
        before = len(decoded)
        link._receive([zmq.Frame(b"\0\0\0\0\x01"), *map(zmq.Frame, _beat("x"))])
        assert len(decoded) == before
        assert link.dropped == {"a lifecycle message naming another node": 1,  # the Register
                                "not a registered worker": 6}  # Deregister, 2 x garbage, 3 x nameless
    finally:
        for sock in (w3, intruder, *nameless):
            sock.close()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        link.close()


async def test_a_malformed_register_does_not_stop_the_reader(tiny_dir):
    """The wire checks no field types: a Register whose cell is a string failed in the cluster's
    handler and ended the reader, and with it every call. Now it is dropped, nothing kept."""
    from gyre.coordinator.local import LocalCluster

    cluster = LocalCluster(tiny_dir, cells=1, spawn=False)
    link = cluster.link
    await link.start()
    reader = asyncio.create_task(link.serve())
    intruder, worker = _dealer(link, b"intruder"), _dealer(link, b"w0")
    reg = dict(req_id=1, node_rank=0, host="h", pid=1, devices=[], backends={})
    try:
        await intruder.send_multipart(wire.encode(wire.Register(node_id="intruder", cell="0", **reg)))
        await intruder.send_multipart(_beat("intruder"))  # read in order: answered once the Register was handled
        again, _ = wire.decode(await asyncio.wait_for(intruder.recv_multipart(), 30))
        assert isinstance(again, wire.Reregister)  # a heartbeat of a node it does not know
        await worker.send_multipart(wire.encode(wire.Register(node_id="w0", cell=0, **reg)))
        welcome, _ = wire.decode(await asyncio.wait_for(worker.recv_multipart(), 30))
        assert isinstance(welcome, wire.Welcome) and welcome.cell == 0 and not reader.done()
        assert link.dropped == {"malformed": 1} and list(link.nodes) == ["w0"]
    finally:
        for sock in (intruder, worker):
            sock.close()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        link.close()


def test_an_unauthenticated_link_binds_loopback_only(tmp_path, tiny_dir):
    from typer.testing import CliRunner

    from gyre.cli.main import app
    from gyre.coordinator.config import CoordinatorConfig

    def config(**kw):
        return CoordinatorConfig(run_dir=tmp_path, model_dir=tiny_dir, workers="external", **kw)

    for address in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://eth0:5555", "tcp://10.1.2.3:5555",
                    "tcp://[::]:5555", "tcp://gpu-host:5555"):
        with pytest.raises(ValueError) as e:
            config(address=address)
        assert str(e.value) == (f"address {address} is not on loopback and keys_dir is unset: any process that "
                                "reaches it could pose as a worker; run `gyre keys init DIR` and set keys_dir = DIR, "
                                "or set allow_unauthenticated_link = true to bind it without keys")
    for address in ("tcp://127.0.0.1:5555", "tcp://127.0.0.2:5555", "tcp://[::1]:5555", "tcp://localhost:5555",
                    "tcp://lo:5555", "ipc:///tmp/gyre-link"):
        config(address=address)
    config(address="tcp://0.0.0.0:5555", keys_dir=tmp_path / "keys")
    config(address="tcp://0.0.0.0:5555", allow_unauthenticated_link=True)
    r = CliRunner().invoke(app, ["up", "--no-live", "--model", str(tiny_dir), "--set", "workers=external",
                                 "--set", "address=tcp://0.0.0.0:5555", "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "gyre keys init" in r.output
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(30)
async def test_an_opted_in_unauthenticated_link_says_so_at_start(caplog):
    # 192.0.2.1 (TEST-NET-1) is no address of this host: the warning comes first, then the
    # bind fails, so nothing ever listens beyond loopback.
    link = WorkerLink("tcp://192.0.2.1:5555")
    with caplog.at_level("WARNING", logger="gyre.coordinator"), pytest.raises(zmq.ZMQError):
        await link.start()
    link.close()
    assert "the worker link tcp://192.0.2.1:5555 is not on loopback and has no CURVE keys" in caplog.text

"""link.py: the coordinator's ZeroMQ link to every workerd (one ROUTER socket).

Request/reply by `req_id` (futures), generation streams by `req_id` (queues), and
lifecycle messages (Register, Ready, Heartbeat, Deregister, WorkerDead) handed to a
callback. A node that dies fails every pending future for it with `WorkerDeadError`.
A reply counts only from the connection the request went to, and a connection that has
not registered is read no further than its first frame (the port may be open to processes
that hold no key: see `_receive`). Not a scheduler: it never decides where work goes.

The link assigns every request's `req_id`. Its transport is ZeroMQ unless it is given another:
`gyre.workerd.inproc.InprocWorkers` runs the workers on threads of this process and hands their
messages to `deliver` (the coordinator only receives it; of workerd it imports the wire and
the light, torch-free modules tests/test_layering.py lists: here keys.py, the CURVE keys).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import zmq
import zmq.asyncio

from gyre.workerd import wire

log = logging.getLogger("gyre.coordinator")

LIFECYCLE = (wire.Register, wire.Ready, wire.Heartbeat, wire.Deregister, wire.WorkerDead)
# ZeroMQ queues at most this many messages per connection; past it, it stops reading that
# connection and TCP pushes back on the sender (0, unbounded, let a flood grow without end).
RECV_HWM = 1000
RECV_BATCH = 256  # messages read before the reader lets the event loop run other tasks
# What a connection that has not registered may send, how large, and how many per second
# (a bucket per kind, its burst the second number): a Register, or the Heartbeat of a worker
# an earlier coordinator welcomed (answered with Reregister). Anything else is dropped unread.
UNREGISTERED = {b"Register": (200.0, 1000), b"Heartbeat": (200.0, 1000)}
UNREGISTERED_MAX_BYTES = 64 << 10  # a Register's payload is a few hundred bytes
DROP_LOG_S = 10.0  # dropped messages are reported at most this often


class WorkerDeadError(wire.GyreError):
    """The node serving a request died or left; the request may be retried elsewhere."""


class WorkerCallTimeout(wire.GyreError):
    """A worker did not answer a command within its timeout (the work may still be running there)."""


class WorkerError(wire.GyreError):
    """The workerd answered a command with an Error (or a reply of the wrong type); `kind`
    names the worker-side exception class. A request's error names the command and the node."""

    def __init__(self, kind: str, message: str, command: str | None = None, where: str | None = None):
        text = f"{kind}: {message}"
        super().__init__(f"{command} on {where} failed: {text}" if command else text)
        self.kind = kind


class Transport(Protocol):
    """Frames to and from workers other than over ZeroMQ (gyre.workerd.inproc.InprocWorkers):
    `start` returns the address workers use; a worker's message comes back through
    `WorkerLink.deliver`, on the link's event loop."""

    async def start(self, link: WorkerLink) -> str: ...

    def send(self, node: str, frames: list) -> None:
        """KeyError: no such worker (it is gone)."""

    def close(self) -> None: ...


@dataclass
class _Pending:
    node: str
    future: asyncio.Future | None = None  # one reply
    stream: asyncio.Queue | None = None  # many GenerateChunks
    on_frames: Callable[[Any, list], None] | None = None


@dataclass
class NodeLink:
    node_id: str
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True


class WorkerLink:
    def __init__(self, bind: str, on_event: Callable[[Any], None] | None = None, keys_dir: Path | None = None,
                 call_timeout_s: float = 600.0, transport: Transport | None = None):
        self._bind = bind
        self._transport = transport  # None: ZeroMQ, bound at `bind`
        self.call_timeout_s = call_timeout_s  # a call's default bound (worker_call_timeout_s)
        self.describe: Callable[[str], str] = lambda node: f"node {node}"  # for errors: "cell 1 (local-1)"
        self._keys_dir = keys_dir  # CURVE: only workers with an authorised key may connect
        self._auth = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self.nodes: dict[str, NodeLink] = {}
        self.on_event = on_event or (lambda msg: None)
        self.address = bind
        self.dropped: dict[str, int] = {}  # messages dropped, by reason (a handful of fixed reasons)
        self._unreported = 0  # dropped since the last report
        self._report_at = 0.0  # monotonic time of the next report allowed
        # Unregistered connections' messages let through: kind -> [tokens, last refill].
        self._buckets = {kind: [float(burst), time.monotonic()] for kind, (_, burst) in UNREGISTERED.items()}

    def rebind(self, bind: str) -> None:
        """Bind at `bind` instead, when started (a resume's: where its workerds listen)."""
        self._bind = bind

    async def start(self) -> str:
        """Bind (created here, after uvloop is installed); returns the bound address."""
        from gyre.workerd.keys import on_loopback

        if self._transport is not None:
            self.address = await self._transport.start(self)
            return self.address
        self._ctx = zmq.asyncio.Context()
        if self._keys_dir is None and not on_loopback(self._bind):  # the run config opted in (allow_...)
            log.warning("the worker link %s is not on loopback and has no CURVE keys: any process that reaches it "
                        "can register as a worker and answer requests; set keys_dir (gyre keys init DIR)", self._bind)
        sock = self._ctx.socket(zmq.ROUTER)
        if self._keys_dir is not None:
            from zmq.auth.asyncio import AsyncioAuthenticator

            from gyre.workerd.keys import server_keys

            public, secret, authorized = server_keys(self._keys_dir)
            self._auth = AsyncioAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(authorized))
            sock.curve_publickey, sock.curve_secretkey, sock.curve_server = public, secret, True
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable replies raise, never vanish
        # ROUTER_HANDOVER stays off: a second connection claiming a connected worker's routing id
        # is never read (ZeroMQ holds it aside), so what arrives under a worker's id is the worker's.
        sock.setsockopt(zmq.SNDHWM, 0)  # what we send is bounded by our own requests in flight
        sock.setsockopt(zmq.RCVHWM, RECV_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        self._sock = sock  # closed by close(), bound or not
        sock.bind(self._bind)
        self.address = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        return self.address

    def close(self) -> None:
        for p in self._pending.values():
            _fail(p, WorkerDeadError("coordinator link closed"))
        self._pending.clear()
        if self._transport is not None:
            self._transport.close()
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            self._ctx.term()
        self._sock = self._auth = self._ctx = None

    # --- sending ------------------------------------------------------------------------

    async def send(self, node: str, msg: Any, tensors: list[wire.TensorFrame] | None = None,
                   force: bool = False) -> None:
        """`force`: to a node marked dead, or never registered, that still talks (Reregister)."""
        link = self.nodes.get(node)
        if not force and (link is None or not link.alive):
            raise WorkerDeadError(f"node {node} is not connected")
        try:
            if self._transport is not None:
                self._transport.send(node, wire.encode(msg, tensors))
            else:
                await self._sock.send_multipart([node.encode(), *wire.encode(msg, tensors)], copy=False)
        except (zmq.ZMQError, KeyError) as e:  # EHOSTUNREACH under ROUTER_MANDATORY; a worker gone
            if link is not None:
                self.mark_dead(node, f"send failed: {e}")
            raise WorkerDeadError(f"node {node} unreachable: {e}") from None

    async def request(self, node: str, msg: Any, tensors: list[wire.TensorFrame] | None = None,
                      timeout: float | None = -1.0) -> Any:
        """Send a command and return its typed reply (`wire.REPLIES[type(msg)]`): a command
        whose reply carries tensors (ExportWeights) goes through `call` instead."""
        reply, _ = await self.call(node, msg, tensors, timeout)
        return reply

    async def call(self, node: str, msg: Any, tensors: list[wire.TensorFrame] | None = None,
                   timeout: float | None = -1.0) -> tuple[Any, list[wire.TensorFrame]]:
        """Send a command and wait for its reply and the reply's tensors. An `Error` reply, or
        one that is not the command's type in `wire.REPLIES`, raises `WorkerError` naming the
        command and the node; no reply within `timeout` (default: the link's `call_timeout_s`;
        None: unbounded) raises `WorkerCallTimeout`, naming them too."""
        bound = "" if timeout is not None and timeout >= 0 else " (worker_call_timeout_s)"
        if timeout is not None and timeout < 0:
            timeout = self.call_timeout_s
        what = type(msg).__name__ + (f" {msg.method}" if isinstance(msg, wire.Call) else "")
        msg = dataclasses.replace(msg, req_id=next(self._ids))
        fut = asyncio.get_running_loop().create_future()
        self._pending[msg.req_id] = _Pending(node, future=fut)
        try:
            await self.send(node, msg, tensors)
            reply, frames = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise WorkerCallTimeout(f"{self.describe(node)} did not answer {what} within {timeout:g} s"
                                    f"{bound}") from None
        finally:
            self._pending.pop(msg.req_id, None)
        if isinstance(reply, wire.Error):
            raise WorkerError(reply.kind, reply.message, what, self.describe(node))
        if isinstance(reply, wire.CallResult) and reply.error:
            raise WorkerError("CallError", reply.error, what, self.describe(node))
        expected = wire.REPLIES.get(type(msg))
        if expected is not None and not isinstance(reply, expected):
            raise WorkerError("WireError", f"answered {type(reply).__name__}, not {expected.__name__}",
                              what, self.describe(node))
        return reply, frames

    async def generate(self, node: str, msg: wire.Generate, tensors: list[wire.TensorFrame] | None = None,
                       on_frames: Callable[[Any, list[wire.TensorFrame]], None] | None = None,
                       ) -> AsyncIterator[wire.GenerateChunk]:
        """Stream a request's chunks until the finished one. The caller aborts on cancel.
        Chunks that carry frames (a handed-back request's KV) also go to `on_frames`."""
        q: asyncio.Queue = asyncio.Queue()
        msg = dataclasses.replace(msg, req_id=next(self._ids))
        self._pending[msg.req_id] = _Pending(node, stream=q, on_frames=on_frames)
        try:
            await self.send(node, msg, tensors)
            while True:
                item = q.get_nowait() if not q.empty() else await q.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, wire.Error):
                    raise WorkerError(item.kind, item.message)
                yield item
                if item.finished:
                    return
        finally:
            self._pending.pop(msg.req_id, None)

    # --- receiving ----------------------------------------------------------------------

    async def serve(self) -> None:
        """Reader loop: run as a task for the coordinator's lifetime."""
        if self._transport is not None:  # it calls deliver: nothing to read
            await asyncio.Future()
        while True:
            self._receive(await self._sock.recv_multipart(copy=False))
            # Then what is queued already, a batch at a time, and the loop's other tasks in
            # between: awaiting a socket that holds a message never yields, so a flood read
            # only by awaits starved every call (and a NOBLOCK read costs a third of an await).
            for _ in range(RECV_BATCH):
                ready = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                try:
                    frames = ready.result()
                except zmq.Again:
                    break
                self._receive(frames)
            await asyncio.sleep(0)

    def _receive(self, frames: list[zmq.Frame]) -> None:
        """One message: who sent it first, then (only for a registered worker, or a small
        Register or Heartbeat within its rate) what it says."""
        # 1) Who: the connection's routing id. A peer picks its own (without keys, any local
        #    process can connect), but ZeroMQ never reads a second connection claiming one in use,
        #    so what arrives under a registered worker's id comes from that worker's connection.
        raw = frames[0].bytes
        if raw[:1] == b"\0":  # ZeroMQ's own id for a peer that names none (b"\0" + a counter); no worker's
            return self._drop(raw, "not a registered worker")
        try:
            node = raw.decode()
        except UnicodeDecodeError:
            return self._drop(raw, "not a registered worker")
        # 2) A connection that has not registered: dropped on its kind frame alone unless it
        #    registers (or heartbeats, for Reregister), small and within the rate. A flood costs
        #    a lookup per message, never a decode, and nothing is kept per connection.
        if node not in self.nodes and not self._admit_unregistered(frames):
            return self._drop(node, "not a registered worker")
        self.deliver(node, frames[1:])

    def deliver(self, node: str, frames: list) -> None:
        """One message from `node`, past `_receive`'s guards (or from a transport's worker in
        this process, which has no unknown peers): decoded, then dispatched."""
        try:
            msg, tensors = wire.decode(frames)
        except wire.WireError as e:
            return self._drop(node, "undecodable", str(e))
        try:
            self._dispatch(node, msg, tensors)
        except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong type (wire checks none)
            if isinstance(msg, wire.Register):
                self.nodes.pop(node, None)  # not registered after all
            self._drop(node, "malformed", f"{type(msg).__name__}: {type(e).__name__}: {e}")

    def _admit_unregistered(self, frames: list[zmq.Frame]) -> bool:
        rate = UNREGISTERED.get(frames[1].bytes) if len(frames) == 3 else None
        if rate is None or len(frames[2]) > UNREGISTERED_MAX_BYTES:
            return False
        bucket, now = self._buckets[frames[1].bytes], time.monotonic()
        bucket[0] = min(float(rate[1]), bucket[0] + (now - bucket[1]) * rate[0])
        bucket[1] = now
        if bucket[0] < 1.0:
            return False
        bucket[0] -= 1.0
        return True

    def _dispatch(self, node: str, msg: Any, tensors: list[wire.TensorFrame]) -> None:
        link = self.nodes.get(node)
        if isinstance(msg, LIFECYCLE):
            # A worker speaks for itself only: a Register, Ready or Deregister naming another
            # node (its connection, or a connection posing as it) would re-welcome or kill that one.
            if msg.node_id != node:
                return self._drop(node, "a lifecycle message naming another node", repr(msg.node_id))
            if isinstance(msg, wire.Register):  # a new session (the cluster may refuse it: refuse())
                link = self.nodes[node] = NodeLink(node)
            if link is None:  # a Heartbeat, unregistered: the cluster asks it to register again
                self.on_event(msg)
                return
            link.last_seen = time.monotonic()
            if isinstance(msg, (wire.Deregister, wire.WorkerDead)):
                reason = getattr(msg, "reason", "")
                self.mark_dead(node, f"{type(msg).__name__}: {reason}")
            elif isinstance(msg, (wire.Register, wire.Ready)):
                link.alive = True
            # A Heartbeat never revives a node marked dead: it must register again (the
            # cluster answers such heartbeats with Reregister), so its state is fresh.
            self.on_event(msg)
            return
        if link is None:  # only Register and Heartbeat get past _receive unregistered
            return self._drop(node, "not a registered worker")
        link.last_seen = time.monotonic()
        pending = self._pending.get(getattr(msg, "req_id", -1))
        if pending is None:
            log.debug("reply %s for no pending request", type(msg).__name__)
            return
        if pending.node != node:  # req_ids are guessable (1, 2, 3, ...): the sender is not
            return self._drop(node, "a reply to a request sent to another node", f"req_id {msg.req_id}")
        if pending.stream is not None:
            if tensors and pending.on_frames is not None:
                pending.on_frames(msg, tensors)
            pending.stream.put_nowait(msg)
        elif not pending.future.done():
            pending.future.set_result((msg, tensors))

    def refuse(self, node: str, why: str) -> None:
        """The cluster refused `node`'s Register: forget it (its messages are dropped unread
        from now on) and report it, at most every DROP_LOG_S with the others."""
        self.nodes.pop(node, None)
        self._drop(node, "registration refused", why)

    def _drop(self, who: str | bytes, reason: str, detail: str = "") -> None:
        """Count a dropped message; warn at once, then at most every DROP_LOG_S seconds."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        self._unreported += 1
        now = time.monotonic()
        if now < self._report_at:
            return
        log.warning("worker link: dropped %d message(s) since the last report, the last from %s: %s%s "
                    "(reported at most every %g s)", self._unreported, repr(who)[:80], reason,
                    f" ({detail[:200]})" if detail else "", DROP_LOG_S)
        self._unreported, self._report_at = 0, now + DROP_LOG_S

    def mark_dead(self, node: str, reason: str) -> None:
        """Fail everything pending on `node`; called on WorkerDead, Deregister or silence."""
        link = self.nodes.get(node)
        if link is not None:
            link.alive = False
        err = WorkerDeadError(f"node {node} died: {reason}")
        for p in self._pending.values():
            if p.node == node:
                _fail(p, err)

    def silent_nodes(self, timeout_s: float) -> list[str]:
        now = time.monotonic()
        return [n for n, node in self.nodes.items() if node.alive and now - node.last_seen > timeout_s]


def _fail(p: _Pending, err: Exception) -> None:
    if p.stream is not None:
        p.stream.put_nowait(err)
    elif p.future is not None and not p.future.done():
        p.future.set_exception(err)

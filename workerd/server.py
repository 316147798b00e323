"""server.py: `WorkerServer`, the thin shell around `Worker`, and its ZeroMQ I/O.

`ZmqIO`'s thread owns the DEALER socket to the coordinator: it moves incoming frames to the
server's inbox (bounded: when the main thread falls behind it stops reading, and ZeroMQ
pushes back on the coordinator), forwards outgoing frames that the main thread pushes over
an inproc pair, and sends heartbeats. The main thread blocks for input only when the engine
is idle and otherwise steps the engine, so backend calls never wait on the network. The
same server runs in the coordinator's process over queues instead (inproc.py). Not the
logic: that is worker.py.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import threading
import time
import traceback
from pathlib import Path

import zmq

from gyre.workerd import wire
from gyre.workerd.config import WorkerConfig
from gyre.workerd.worker import Out, Worker

log = logging.getLogger("gyre.workerd")

# The inbox holds at most this many messages, or bytes (one larger message, a LoadWeights,
# still passes: the bound is checked before each read); past either, the I/O thread stops
# reading and ZeroMQ queues at most RECV_HWM more before TCP pushes back on the coordinator.
INBOX_MAX = 256
INBOX_MAX_BYTES = 64 << 20
RECV_HWM = 16


class HandshakeTimeout(wire.GyreError):
    """No Welcome from the coordinator within the deadline."""


class WelcomeFailed(wire.GyreError):
    """The backends could not be built from the coordinator's Welcome."""


class ZmqIO:
    """The I/O thread that owns the DEALER socket to the coordinator: incoming frames to the
    server's inbox while it has room, outgoing frames from the main thread (over an inproc
    PUSH/PULL pair), and heartbeats once welcomed. The other I/O is in process (inproc.py)."""

    def __init__(self, server: WorkerServer):
        self.server = server
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._outbox_addr = f"inproc://gyre-outbox-{id(self)}"
        # The I/O thread binds the PULL end before the main thread connects to it.
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gyre-workerd-io", daemon=True)
        self._push: zmq.Socket | None = None
        self._curve: tuple[bytes, bytes, bytes] | None = None  # (public, secret, coordinator public)

    def start(self) -> None:
        config = self.server.config
        if config.keys_dir is not None:  # read here: a bad key file fails start-up, named
            from gyre.workerd.keys import client_keys

            self._curve = client_keys(Path(config.keys_dir), config.key_name)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("workerd I/O thread did not start")
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.connect(self._outbox_addr)

    def send(self, frames: list) -> None:
        self._push.send_multipart(frames, copy=False)

    def close(self, timeout: float) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout)
        if self._push is not None:
            self._push.close(linger=0)
        self._ctx.term() if not self._thread.is_alive() else self._ctx.destroy(linger=0)

    def _loop(self) -> None:
        server = self.server
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, server.node_id.encode())
        dealer.setsockopt(zmq.LINGER, 2000)  # let Deregister/WorkerDead leave on exit
        dealer.setsockopt(zmq.SNDHWM, 0)
        dealer.setsockopt(zmq.RCVHWM, RECV_HWM)
        if self._curve is not None:
            dealer.curve_publickey, dealer.curve_secretkey, dealer.curve_serverkey = self._curve
        dealer.connect(server.config.coordinator)
        pull = self._ctx.socket(zmq.PULL)
        pull.bind(self._outbox_addr)
        self._ready.set()
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        next_beat = time.monotonic()
        reading = True
        try:
            while not self._stop.is_set():
                # Read the coordinator only while the inbox has room (else ZeroMQ and TCP hold the
                # rest); paused, look again soon: the main thread drains without telling us.
                if reading != server.inbox_has_room():
                    reading = not reading
                    poller.modify(dealer, zmq.POLLIN if reading else 0)
                timeout = max(0.0, next_beat - time.monotonic()) * 1000 if server.welcomed else 100
                events = dict(poller.poll(timeout=min(timeout, 100 if reading else 5)))
                if dealer in events:
                    server.deliver(dealer.recv_multipart(copy=False))
                if pull in events:
                    dealer.send_multipart(pull.recv_multipart(copy=False), copy=False)
                if server.welcomed and time.monotonic() >= next_beat:
                    dealer.send_multipart(wire.encode(server.heartbeat()))
                    next_beat = time.monotonic() + server.config.heartbeat_s
            # Flush what the main thread queued last (Deregister, WorkerDead).
            while pull.poll(0):
                dealer.send_multipart(pull.recv_multipart(copy=False), copy=False)
        finally:
            pull.close(linger=0)
            dealer.close()  # keeps LINGER so queued frames still leave


class WorkerServer:
    """The worker's main loop over an I/O: ZeroMQ to a coordinator elsewhere (`ZmqIO`, the
    default) or queues to one in this process (inproc.py)."""

    def __init__(self, config: WorkerConfig, worker: Worker | None = None, io=None):
        self.config = config
        self.worker = worker or Worker(config)
        self.node_id = self.worker.node_id
        self.should_exit = False
        self.force_exit = False
        self.welcomed = False
        self._watched = config.parent_pid  # the coordinator we end with (a resume's, once it welcomed us)
        self._orphaned: float | None = None  # when the watched coordinator was found gone (linger_s)
        self._inbox: queue.Queue = queue.Queue()  # bounded by the I/O (INBOX_MAX, INBOX_MAX_BYTES)
        self._inbox_bytes = 0  # held in the inbox; both threads update it, under the lock
        self._inbox_lock = threading.Lock()
        self.io = io(self) if io is not None else ZmqIO(self)

    # --- the I/O's side -----------------------------------------------------------------

    def deliver(self, frames: list) -> None:
        """A message from the coordinator, for the main thread (called on the I/O's thread)."""
        with self._inbox_lock:
            self._inbox_bytes += _nbytes(frames)
        self._inbox.put(frames)

    def inbox_has_room(self) -> bool:
        return self._inbox.qsize() < INBOX_MAX and self._inbox_bytes < INBOX_MAX_BYTES

    def heartbeat(self) -> wire.Heartbeat:
        w = self.worker
        return wire.Heartbeat(node_id=self.node_id, role=w.role.value,
                              running=w.engine.running if w.engine else 0,
                              version=w.engine.version if w.engine else -1, t=time.time())

    # --- main thread --------------------------------------------------------------------

    def send(self, msg, tensors=None) -> None:
        self.io.send(wire.encode(msg, tensors))

    def _send_all(self, outs: list[Out]) -> None:
        for msg, tensors in outs:
            self.send(msg, tensors)

    def start(self) -> None:
        self.io.start()
        self._register()

    def _register(self) -> None:
        cfg = self.config
        self.send(wire.Register(req_id=0, node_id=self.node_id, cell=cfg.cell, node_rank=cfg.node_rank,
                                host=socket.gethostname(), pid=os.getpid(), devices=list(cfg.devices),
                                backends={"engine": cfg.engine_backend, "trainer": cfg.trainer_backend},
                                kept=self.worker.kept_state()))

    def run_forever(self) -> int:
        """Serve until Shutdown or a signal; returns the process exit code."""
        self._deadline = time.monotonic() + self.config.welcome_timeout_s
        while not (self.should_exit or self.worker.should_exit):
            # 1) Block for input only when nothing is running.
            self._drain_inbox(block=not self.worker.busy)
            if self._coordinator_gone():
                break
            if not self.welcomed and time.monotonic() > self._deadline:
                hint = (" (CURVE: is this worker's key in the coordinator's authorized/ directory?)"
                        if self.config.keys_dir else "")
                raise HandshakeTimeout(f"no Welcome from {self.config.coordinator} within "
                                       f"{self.config.welcome_timeout_s:.0f}s{hint}")
            # 2) Advance running work by one step and publish results.
            if self.worker.busy:
                self._send_all(self.worker.step())
        return self._shutdown_gracefully()

    def _coordinator_gone(self) -> bool:
        """Whether to end because the coordinator that spawned us (or resumed the run and
        welcomed us) is gone: at once, or after `linger_s` without a new one welcoming us."""
        pid = self._watched
        if pid is None:
            return False
        gone = os.getppid() != pid if pid == self.config.parent_pid else not _alive(pid)
        if not gone:
            return False
        if not self.config.linger_s:
            log.warning("parent %d is gone; shutting down", pid)
            return True
        now = time.monotonic()
        if self._orphaned is None:
            self._orphaned = now
            log.warning("coordinator %d is gone; keeping the model and trainer %.0fs for the run's resume",
                        pid, self.config.linger_s)
        elif now - self._orphaned > self.config.linger_s:
            log.warning("no coordinator resumed the run within %.0fs; shutting down", self.config.linger_s)
            return True
        return False

    def _drain_inbox(self, block: bool) -> None:
        try:
            # A short timeout, not forever: signals set should_exit and must be seen.
            frames = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        for handled in range(1, INBOX_MAX + 1):
            with self._inbox_lock:
                self._inbox_bytes -= _nbytes(frames)
            self._handle(frames)
            if handled == INBOX_MAX:  # an inbox's worth: the engine steps before the next
                return
            try:
                frames = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, frames) -> None:
        try:
            msg, tensors = wire.decode(frames)
        except wire.WireError as e:
            log.warning("undecodable message: %s", e)
            req_id = wire.req_id_of(frames)
            self.send(wire.Error(req_id=-1 if req_id is None else req_id, kind="WireError", message=str(e)))
            return
        if type(msg) not in self.worker.handlers:
            self.send(wire.Error(req_id=getattr(msg, "req_id", -1), kind="WireError",
                                 message=f"{type(msg).__name__} is not a workerd command"))
            return
        if isinstance(msg, wire.Welcome):
            # Heartbeats start now, from the I/O thread, while the backends are built (SGLang and
            # Megatron take longer than a worker timeout to start): building is not silence.
            self.welcomed = True
            if self.config.parent_pid is not None and msg.coordinator_pid is not None:
                self._watched, self._orphaned = msg.coordinator_pid, None  # a resume's coordinator now
        outs = self.worker.handle(msg, tensors)
        if isinstance(msg, wire.Reregister):
            log.warning("coordinator asks to register again (%s)", msg.reason or "new session")
            self.welcomed = False
            self._deadline = time.monotonic() + self.config.welcome_timeout_s
            self._register()
            return
        if isinstance(msg, wire.Welcome):
            errors = [m for m, _ in outs if isinstance(m, wire.Error)]
            if errors:  # no backends, nothing to serve: die loudly (systemd restarts us)
                raise WelcomeFailed(f"cannot start from the Welcome: {errors[0].kind}: {errors[0].message}")
        self._send_all(outs)

    def _shutdown_gracefully(self) -> int:
        """Hand back in-flight requests (their streams end with `abort`, so the coordinator
        reroutes them), deregister, close. Bounded: the I/O thread gets a deadline."""
        if self.worker.engine is not None:
            self._send_all(self.worker.abort_all())
        if self.welcomed:
            self.send(wire.Deregister(node_id=self.node_id, reason="shutdown"))
        self._close()
        return 0

    def report_fatal(self, exc: BaseException) -> None:
        """Tell the coordinator why we die (best effort), then close."""
        try:
            self.send(wire.WorkerDead(node_id=self.node_id, reason=f"{type(exc).__name__}: {exc}",
                                      traceback="".join(traceback.format_exception(exc))))
        finally:
            self._close()

    def _close(self) -> None:
        self.io.close(self.config.graceful_timeout_s)

    def install_signal_handlers(self) -> None:
        """First SIGTERM/SIGINT: graceful exit. Second SIGINT: exit now."""

        def on_signal(signum, _frame):
            if self.should_exit and signum == signal.SIGINT:
                self.force_exit = True
                os._exit(130)
            self.should_exit = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)


def _nbytes(frames) -> int:
    return sum(len(f) for f in frames)


def serve(config: WorkerConfig) -> int:
    """Entry point of `gyre workerd`: returns the exit code."""
    server = WorkerServer(config)
    server.install_signal_handlers()
    server.start()
    try:
        return server.run_forever()
    except Exception as e:  # noqa: BLE001 - reported to the coordinator, then non-zero exit
        log.exception("workerd fatal error")
        if not server.welcomed:
            # Nobody to report to (no Welcome came: refused key, wrong address). Tearing ZeroMQ
            # down under a half-done CURVE handshake aborted the process now and then (libzmq:
            # "Assertion failed: pfd.revents & POLLIN (src/signaler.cpp:238)"): exit as is.
            logging.shutdown()
            os._exit(1)
        server.report_fatal(e)
        return 1


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited and not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] not in ("Z", "X")

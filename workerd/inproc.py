"""inproc.py: workers in the coordinator's own process, one `Worker` per cell on a thread.

`InprocWorkers` is what a `LocalCluster` is given to start its cells here instead of as
`gyre workerd` processes (`workers = "inproc"`; vLLM's `InprocClient` is the model). It is
both the transport the cluster's `WorkerLink` sends through and the starter of each cell's
thread. The same `WorkerServer` loop runs the same `Worker` as in a process; only the I/O
differs: the link's frames go straight into a server's inbox, and a server's frames come
back to the link on the coordinator's event loop. Messages still pass through
`wire.encode` / `wire.decode`, tensors copied, so neither side ever holds the other's memory.

What needs a process stays on ZeroMQ: signals, CURVE keys, netns relays, a worker that
dies alone, or runs on another host. Not a mock: nothing here answers for a worker.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from gyre.workerd import wire
from gyre.workerd.config import WorkerConfig
from gyre.workerd.server import WorkerServer

log = logging.getLogger("gyre.workerd")


def _copied(frames: list) -> list:
    """Frames as bytes: a tensor frame views its sender's memory (a trainer's parameters)."""
    return [f if isinstance(f, bytes) else memoryview(f).tobytes() for f in frames]


class InprocIO:
    """A `WorkerServer`'s I/O in process: frames to the link through the coordinator's loop,
    and heartbeats from a thread of their own (a long backend call is not silence)."""

    def __init__(self, server: WorkerServer, workers: InprocWorkers):
        self.server = server
        self.workers = workers
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat, name=f"gyre-inproc-beat-{server.node_id}", daemon=True)

    def start(self) -> None:
        self._beats.start()

    def send(self, frames: list) -> None:
        self.workers.to_link(self.server.node_id, _copied(frames))

    def close(self, timeout: float) -> None:
        self._stop.set()
        if self._beats is not threading.current_thread():
            self._beats.join(timeout=timeout)

    def _beat(self) -> None:
        while not self._stop.wait(self.server.config.heartbeat_s if self.server.welcomed else 0.05):
            if self.server.welcomed:
                self.send(wire.encode(self.server.heartbeat()))


class InprocWorker:
    """One cell's thread; awaited and killed as a `gyre workerd` process is (`wait`, `kill`,
    `returncode`), so the cluster starts and ends both the same way."""

    def __init__(self, workers: InprocWorkers, config: WorkerConfig):
        self.server = WorkerServer(config, io=lambda server: InprocIO(server, workers))
        self.workers = workers
        self.node_id = config.node_id
        self.returncode: int | None = None
        self._loop = asyncio.get_running_loop()
        self._exited = self._loop.create_future()
        self.thread = threading.Thread(target=self._main, name=f"gyre-inproc-{config.node_id}", daemon=True)

    def _main(self) -> None:
        server, code = self.server, 1
        try:
            server.start()
            code = server.run_forever()
        except Exception as e:  # noqa: BLE001 - reported to the coordinator, as a process does
            log.exception("in-process worker %s: fatal error", self.node_id)
            server.report_fatal(e)
        finally:
            self.workers.forget(self.node_id, server)  # what is sent to it now fails, as to a dead process
            try:
                self._loop.call_soon_threadsafe(self._exit, code)
            except RuntimeError:  # the coordinator's loop is closed: nobody waits
                pass

    def _exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        if not self._exited.done():
            self._exited.set_result(self.returncode)

    async def wait(self) -> int:
        """The exit code, once the thread has ended (as a process's wait: nothing of it runs
        after); a killed one is not waited for (see kill)."""
        code = await asyncio.shield(self._exited)
        if code != -9:
            await asyncio.get_running_loop().run_in_executor(None, self.thread.join, 10.0)
        return code

    def kill(self) -> None:
        """Ask the thread to stop at its next turn, and count it gone now: a thread cannot be
        killed, and one stuck in a backend call must not hold the cluster's exit."""
        self.server.should_exit = True
        self._exit(-9)


class InprocWorkers:
    """The cluster's workers in this process: the link's transport and the cells' starter."""

    def __init__(self):
        self.address = f"inproc://gyre-workers-{id(self)}"
        self._servers: dict[str, WorkerServer] = {}
        self._link: Any = None  # the coordinator's WorkerLink (it calls start)
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- the link's side (the coordinator's loop) ----------------------------------------

    async def start(self, link: Any) -> str:
        self._link, self._loop = link, asyncio.get_running_loop()
        return self.address

    def send(self, node: str, frames: list) -> None:
        """To `node`'s inbox; KeyError: no such worker here (the link reports it unreachable)."""
        self._servers[node].deliver(_copied(frames))

    def close(self) -> None:
        for server in self._servers.values():
            server.should_exit = True
        self._servers.clear()
        self._link = None

    def spawn(self, *, cell: int, node_id: str, heartbeat_s: float, backends: tuple[str, str]) -> InprocWorker:
        """Start cell `cell`'s worker on a thread: it registers, as a process would."""
        config = WorkerConfig(coordinator=self.address, cell=cell, node_id=node_id, heartbeat_s=heartbeat_s,
                              engine_backend=backends[0], trainer_backend=backends[1])
        worker = InprocWorker(self, config)
        self._servers[node_id] = worker.server
        worker.thread.start()
        return worker

    # --- the workers' side (their threads) -----------------------------------------------

    def forget(self, node: str, server: WorkerServer) -> None:
        if self._servers.get(node) is server:
            del self._servers[node]

    def to_link(self, node: str, frames: list) -> None:
        link, loop = self._link, self._loop
        if link is None or loop is None:
            return  # the link is closed: as frames to a coordinator that is gone
        try:
            loop.call_soon_threadsafe(link.deliver, node, frames)
        except RuntimeError:  # the loop is closed
            pass

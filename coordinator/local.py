"""local.py: a coordinator-side handle on workerd processes started on this machine.

`LocalCluster` binds the ZeroMQ link, starts `gyre workerd` subprocesses (one per cell),
answers their Register with a Welcome naming the model and role, and waits (with a
deadline) until every node is Ready. Used by `gyre up` on the embedded default and by
tests. Not the run loop and not a scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gyre.coordinator.link import WorkerLink
from gyre.workerd import wire

log = logging.getLogger("gyre.coordinator")


class ClusterStartError(wire.GyreError):
    """Worker daemons did not all register and become ready in time."""


@dataclass
class NodeInfo:
    node_id: str
    cell: int
    role: str
    ready: bool = False
    version: int = 0
    registered: wire.Register | None = None


@dataclass
class LocalCluster:
    model_dir: Path
    cells: int = 2
    roles: tuple[str, ...] = ()  # per cell; default: cell 0 rollout, others training
    engine: dict = field(default_factory=dict)
    trainer: dict = field(default_factory=dict)
    address: str = "tcp://127.0.0.1:0"
    start_timeout_s: float = 120.0
    heartbeat_s: float = 0.5
    log_dir: Path | None = None
    keys_dir: Path | None = None  # CURVE: the link authenticates workers; ours use key `key_name`
    key_name: str = "worker"

    def __post_init__(self) -> None:
        # One cell per core at most: oversubscribed torch threads spin and crawl.
        self.engine = {"threads": max(1, (os.cpu_count() or 1) // self.cells), **self.engine}
        self.link = WorkerLink(self.address, on_event=self._on_event, keys_dir=self.keys_dir)
        self.nodes: dict[str, NodeInfo] = {}
        self.procs: list[asyncio.subprocess.Process] = []
        self._ready = asyncio.Event()
        self._reader: asyncio.Task | None = None
        self.events: list = []  # lifecycle messages seen (Register, Ready, WorkerDead, ...)

    def node_of_cell(self, cell: int) -> str:
        return next(n.node_id for n in self.nodes.values() if n.cell == cell)

    def _role_of(self, cell: int) -> str:
        if self.roles:
            return self.roles[cell]
        return "rollout" if cell == 0 else "training"

    def _on_event(self, msg) -> None:
        self.events.append(msg)
        if isinstance(msg, wire.Register):
            cell = msg.cell if msg.cell is not None else len(self.nodes)
            info = NodeInfo(msg.node_id, cell, self._role_of(cell), registered=msg)
            self.nodes[msg.node_id] = info
            welcome = wire.Welcome(req_id=msg.req_id, node_id=msg.node_id, cell=cell, role=info.role,
                                   model_dir=str(self.model_dir), engine=self.engine, trainer=self.trainer,
                                   heartbeat_s=self.heartbeat_s)
            asyncio.ensure_future(self.link.send(msg.node_id, welcome)).add_done_callback(_log_failure)
        elif isinstance(msg, wire.Ready):
            info = self.nodes[msg.node_id]
            info.ready, info.version = True, msg.version
            if len(self.nodes) == self.cells and all(n.ready for n in self.nodes.values()):
                self._ready.set()
        elif isinstance(msg, wire.WorkerDead):
            log.error("workerd %s died: %s", msg.node_id, msg.reason)

    async def __aenter__(self) -> LocalCluster:
        address = await self.link.start()
        self._reader = asyncio.create_task(self.link.serve(), name="gyre-link-reader")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for cell in range(self.cells):
            out = None
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                out = open(self.log_dir / f"workerd-{cell}.log", "ab")
            self.procs.append(await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gyre.cli", "workerd", "--coordinator", address,
                "--cell", str(cell), "--node-id", f"local-{cell}", "--heartbeat", str(self.heartbeat_s),
                "--parent-pid", str(os.getpid()),
                *(("--keys", str(self.keys_dir), "--key-name", self.key_name) if self.keys_dir else ()),
                env=env, stdout=out or asyncio.subprocess.DEVNULL, stderr=out or None,
            ))
            if out is not None:
                out.close()
        try:
            await asyncio.wait_for(self._wait_ready(), self.start_timeout_s)
        except (asyncio.TimeoutError, ClusterStartError) as e:
            await self.__aexit__(None, None, None)
            ready = sorted(n.node_id for n in self.nodes.values() if n.ready)
            raise ClusterStartError(f"{self.cells} workerd processes did not become ready in "
                                    f"{self.start_timeout_s:.0f}s (ready: {ready or 'none'}): {e}") from None
        return self

    async def _wait_ready(self) -> None:
        waiter = asyncio.create_task(self._ready.wait())
        exits = [asyncio.create_task(p.wait()) for p in self.procs]
        done, _ = await asyncio.wait([waiter, *exits], return_when=asyncio.FIRST_COMPLETED)
        for t in [waiter, *exits]:
            t.cancel()
        if waiter not in done:
            codes = [p.returncode for p in self.procs]
            raise ClusterStartError(f"a workerd exited during start-up (exit codes {codes})")

    async def __aexit__(self, *exc) -> None:
        for node in list(self.nodes):
            if self.link.nodes.get(node) and self.link.nodes[node].alive:
                try:
                    await self.link.call(node, wire.Shutdown(req_id=self.link.new_req_id()), timeout=5)
                except Exception as e:  # noqa: BLE001 - escalated to terminate/kill below
                    log.warning("shutdown of %s: %s", node, e)
        for p in self.procs:
            try:
                await asyncio.wait_for(p.wait(), 10)
            except asyncio.TimeoutError:
                p.kill()
                await p.wait()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
        self.link.close()


def _log_failure(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("sending Welcome failed: %s", fut.exception())

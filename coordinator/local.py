"""local.py: a coordinator-side handle on workerd processes started on this machine.

`LocalCluster` binds the ZeroMQ link, starts `gyre workerd` subprocesses (one per cell; or,
given `workers` (gyre.workerd.inproc.InprocWorkers), one worker thread per cell in this process),
answers their Register with a Welcome naming the model and role, and waits (with a
deadline) until every node is Ready. Used by `gyre up` on the embedded default and by
tests. Not the run loop and not a scheduler.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gyre.coordinator.link import WorkerLink
from gyre.workerd import wire

log = logging.getLogger("gyre.coordinator")

EVENTS_KEPT = 10_000  # lifecycle messages kept in `events` (a registration flood must not grow it)
WORKERS_FILE = "workers.json"  # the spawned workerds' address and pids, for a resume to take them back


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
    rejoin: bool = False  # registered after start-up (a replacement for a dead node)
    kept: bool = False  # ready with the backends it held (a restart of the same run: wire.Ready.kept)
    trainer_version: int | None = None


@dataclass
class LocalCluster:
    model_dir: Path
    cells: int = 2
    roles: tuple[str, ...] = ()  # per cell; default: cell 0 rollout, others training
    # What every cell is welcomed with: the wire's specs, or a dict of gyre's option names (a
    # spec's fields) and the backend's own, which become the spec's `options`.
    engine: wire.EngineSpec | dict = field(default_factory=dict)
    trainer: wire.TrainerSpec | dict = field(default_factory=dict)
    address: str = "tcp://127.0.0.1:0"
    start_timeout_s: float = 120.0
    heartbeat_s: float = 0.5
    log_dir: Path | None = None
    keys_dir: Path | None = None  # CURVE: the link authenticates workers; ours use key `key_name`
    key_name: str = "worker"
    spawn: bool = True  # False: start nothing, wait for `cells` workerds started elsewhere to register
    backends: tuple[str, str] = ("cpu", "cpu")  # (engine, trainer) of the workerds it spawns
    call_timeout_s: float = 600.0  # a worker call's default bound (micro-steps, checkpoints, ...)
    # The workers in this process (workers = "inproc": gyre.workerd.inproc.InprocWorkers, handed
    # in by whoever builds the coordinator): the link's transport and each cell's starter.
    workers: Any = None
    # A restart of a run (its id: rundir.run_id) at this version: workerds that kept their
    # backends from it, their trainers at this version, are welcomed to keep them (no reload).
    run_id: str = ""
    resume_version: int | None = None
    # Spawned workerds outlive a coordinator that dies by this long (workerd --linger), and
    # `state_file` records where they listen and their pids, so that a resume binds the same
    # address and takes them back instead of spawning new ones.
    linger_s: float = 0.0
    state_file: Path | None = None

    def __post_init__(self) -> None:
        if isinstance(self.engine, dict):
            self.engine = wire.EngineSpec.from_options(self.engine)
        if isinstance(self.trainer, dict):
            self.trainer = wire.TrainerSpec.from_options(self.trainer)
        if self.engine.threads is None:  # one cell per core at most: oversubscribed torch threads spin and crawl
            self.engine = replace(self.engine, threads=max(1, (os.cpu_count() or 1) // self.cells))
        self.link = WorkerLink(self.address, on_event=self._on_event, keys_dir=self.keys_dir,
                               call_timeout_s=self.call_timeout_s, transport=self.workers)
        self.link.describe = self.describe
        self.nodes: dict[str, NodeInfo] = {}
        self.procs: list = []  # asyncio.subprocess.Process, or InprocWorker: waited and killed alike
        self._ready = asyncio.Event()
        self._reader: asyncio.Task | None = None
        # Lifecycle messages seen (Register, Ready, WorkerDead, ...), the latest EVENTS_KEPT;
        # heartbeats are only counted: a long run's would fill it.
        self.events: deque = deque(maxlen=EVENTS_KEPT)
        self.heartbeats = 0
        self.on_rejoin: Callable[[int, str], None] | None = None  # (cell, node) ready after start-up
        self._reregistering: set[str] = set()  # nodes asked to register again, not yet registered
        self.hand_off = False  # a stop for a restart (SIGUSR1): the workerds are left running, not shut down

    def _engine_of(self, cell: int) -> wire.EngineSpec:
        """The engine spec for `cell`: its own sampling seed. With one seed for all, the
        executions of a group (one prompt, one per cell) sampled the same text on every cell,
        and a group of equal rewards has no advantage to train on."""
        return replace(self.engine, seed=self.engine.seed * 1009 + cell)

    def describe(self, node: str) -> str:
        info = self.nodes.get(node)
        return f"cell {info.cell} ({node})" if info is not None else f"node {node}"

    def node_of_cell(self, cell: int) -> str:
        return next(n.node_id for n in self.nodes.values() if n.cell == cell)

    def reducer_init(self, run_dir: Path, port: int = 29500) -> str:
        """Where the gradient reducer's ranks meet: a file in the run directory when every
        worker runs on this host, else a TCP store on cell 0's host."""
        import secrets
        import socket

        hosts = {n.registered.host for n in self.nodes.values() if n.registered is not None}
        if hosts <= {socket.gethostname()}:  # an absolute path: file://runs/x would name a host "runs"
            return f"file://{Path(run_dir).resolve() / f'.rendezvous-{secrets.token_hex(4)}'}"
        core = next(n for n in self.nodes.values() if n.cell == 0)
        return f"tcp://{core.registered.host}:{port}"

    def transfer_host(self, node: str, configured: str | None) -> str:
        """Where other nodes reach `node`'s transfer engine: the configured address, else
        loopback for workers we started, else the host it registered from."""
        if configured:
            return configured
        info = self.nodes.get(node)
        if self.spawn or info is None or info.registered is None:
            return "127.0.0.1"
        return info.registered.host

    def kept_cells(self) -> dict[int, tuple[int, int | None]]:
        """The cells whose workerd kept its backends from this run's earlier coordinator:
        cell -> (its engine's version, its trainer's)."""
        return {n.cell: (n.version, n.trainer_version) for n in self.nodes.values() if n.ready and n.kept}

    def _alive(self, node: str) -> bool:
        link = self.link.nodes.get(node)
        return link is not None and link.alive

    def _free_cell(self) -> int | None:
        held = {n.cell for n in self.nodes.values() if self._alive(n.node_id)}
        return next((c for c in range(self.cells) if c not in held), None)

    def _kept_cell(self, msg: wire.Register) -> int | None:
        """The cell a workerd held in this run before its coordinator restarted, if it is free:
        the core's trainer (its optimizer state) stays the core's."""
        kept = msg.kept or {}
        cell = kept.get("cell")
        if not self.run_id or kept.get("run") != self.run_id or not isinstance(cell, int) or not 0 <= cell < self.cells:
            return None
        holder = next((n for n in self.nodes.values() if n.cell == cell and n.node_id != msg.node_id), None)
        return cell if holder is None or not self._alive(holder.node_id) else None

    def _role_of(self, cell: int) -> str:
        if self.roles:
            return self.roles[cell]
        return "rollout" if cell == 0 else "training"

    def _on_event(self, msg) -> None:
        """The link's lifecycle messages; it has checked that each comes from the node it names."""
        if isinstance(msg, wire.Heartbeat):
            self.heartbeats += 1
        else:
            self.events.append(msg)
        if isinstance(msg, wire.Register):
            self._reregistering.discard(msg.node_id)
            cell = msg.cell
            if cell is None:
                cell = self._kept_cell(msg)
                cell = self._free_cell() if cell is None else cell
            holder = next((n for n in self.nodes.values() if n.cell == cell and n.node_id != msg.node_id), None)
            if cell is None or cell >= self.cells or (holder is not None and self._alive(holder.node_id)):
                # Logged by the link, at most every few seconds: a flood of Registers is one line.
                self.link.refuse(msg.node_id, f"cell {cell} is " + (
                    "out of range" if cell is None or cell >= self.cells else f"held by {holder.node_id}"))
                return
            if holder is not None:
                del self.nodes[holder.node_id]
            info = NodeInfo(msg.node_id, cell, self._role_of(cell), registered=msg, rejoin=self._ready.is_set())
            self.nodes[msg.node_id] = info
            welcome = wire.Welcome(req_id=msg.req_id, node_id=msg.node_id, cell=cell, role=info.role,
                                   model_dir=str(self.model_dir), engine=self._engine_of(cell), trainer=self.trainer,
                                   heartbeat_s=self.heartbeat_s, run=self.run_id,
                                   version=None if info.rejoin else self.resume_version,
                                   coordinator_pid=os.getpid() if self.spawn and self.workers is None else None)
            asyncio.ensure_future(self.link.send(msg.node_id, welcome)).add_done_callback(_log_failure)
        elif isinstance(msg, wire.Ready):
            info = self.nodes.get(msg.node_id)
            if info is None:
                return
            info.ready, info.version = True, msg.version
            info.kept, info.trainer_version = msg.kept, msg.trainer_version
            if not self._ready.is_set() and not info.rejoin:
                log.info("workerd %s ready as cell %d (%d/%d)", msg.node_id, info.cell,
                         sum(n.ready for n in self.nodes.values()), self.cells)
            if info.rejoin:
                if self.on_rejoin is not None:
                    self.on_rejoin(info.cell, msg.node_id)
            elif len(self.nodes) == self.cells and all(n.ready for n in self.nodes.values()):
                self._ready.set()
        elif isinstance(msg, wire.WorkerDead):
            log.error("workerd %s died: %s", msg.node_id, msg.reason)
        elif isinstance(msg, wire.Heartbeat) and (msg.node_id not in self.nodes or not self._alive(msg.node_id)):
            # A worker welcomed by an earlier coordinator (we restarted, e.g. to resume), or one
            # declared dead after a silence that has come back: it must register again.
            if msg.node_id not in self._reregistering:
                if len(self._reregistering) >= EVENTS_KEPT:  # unregistered peers that never register
                    self._reregistering.clear()
                self._reregistering.add(msg.node_id)
                log.info("workerd %s is unknown or was declared dead: asking it to register again", msg.node_id)
                asyncio.ensure_future(self.link.send(msg.node_id, wire.Reregister(reason="new session"), force=True)
                                      ).add_done_callback(_log_failure)

    async def __aenter__(self) -> LocalCluster:
        before, lingering = self._lingering()
        if lingering:
            self.link.rebind(before)
        try:
            address = await self.link.start()
        except Exception as e:  # noqa: BLE001 - the address is taken: new workerds at a new one
            if not lingering:
                raise
            log.warning("cannot listen again at %s (%s): the workerds still running from before are left to end; "
                        "starting new ones", self.address, e)
            lingering = {}
            self.link.close()
            self.link.rebind(self.address)
            address = await self.link.start()
        self._reader = asyncio.create_task(self.link.serve(), name="gyre-link-reader")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if not self.spawn:
            log.info("waiting up to %.0fs for %d workerds at %s (gyre workerd --coordinator ADDRESS)",
                     self.start_timeout_s, self.cells, address)
        if lingering:
            log.info("taking back %d workerd(s) the earlier coordinator left running (cells %s)", len(lingering),
                     ", ".join(map(str, sorted(lingering))))
        for cell in range(self.cells if self.spawn else 0):
            if cell in lingering:
                self.procs.append(Lingering(lingering[cell]))
                continue
            if self.workers is not None:
                self.procs.append(self.workers.spawn(cell=cell, node_id=f"local-{cell}", heartbeat_s=self.heartbeat_s,
                                                     backends=self.backends))
                continue
            out = None
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                out = open(self.log_dir / f"workerd-{cell}.log", "ab")
            self.procs.append(await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gyre.cli", "workerd", "--coordinator", address,
                "--cell", str(cell), "--node-id", f"local-{cell}", "--heartbeat", str(self.heartbeat_s),
                "--parent-pid", str(os.getpid()), "--linger", f"{self.linger_s:g}",
                "--engine-backend", self.backends[0], "--trainer-backend", self.backends[1],
                *(("--keys", str(self.keys_dir), "--key-name", self.key_name) if self.keys_dir else ()),
                env=env, stdout=out or asyncio.subprocess.DEVNULL, stderr=out or None,
                # Its own session: a terminal's Ctrl-C goes to the whole foreground process
                # group, and a workerd that took it died before the coordinator's stop could
                # save the last trained step. The coordinator ends them (Shutdown, then kill),
                # and --parent-pid ends them if it dies.
                start_new_session=True,
            ))
            if out is not None:
                out.close()
        self._record(address)
        try:
            await asyncio.wait_for(self._wait_ready(), self.start_timeout_s)
        except (TimeoutError, ClusterStartError) as e:
            await self.__aexit__(None, None, None)
            ready = sorted(n.node_id for n in self.nodes.values() if n.ready)
            raise ClusterStartError(f"{self.cells} workerd processes did not become ready in "
                                    f"{self.start_timeout_s:.0f}s (ready: {ready or 'none'}; "
                                    f"registered: {len(self.nodes)}): {e}") from None
        return self

    def _lingering(self) -> tuple[str, dict[int, int]]:
        """A resume's workerds still running from the earlier coordinator (state_file): where
        they listen and {cell: pid}, empty when none is (or this is no resume of spawned
        workerds). A pid counts only while its command line is that cell's `gyre workerd` at
        that address: a pid reused by another process is not taken."""
        if self.resume_version is None or not self.spawn or self.workers is not None or self.state_file is None:
            return "", {}
        try:
            recorded = json.loads(self.state_file.read_text())
            address, pids = recorded["address"], {int(c): int(p) for c, p in recorded["pids"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return "", {}
        found: dict[int, int] = {}
        for cell, pid in pids.items():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"workerd" in argv and address.encode() in argv and f"local-{cell}".encode() in argv \
                    and cell < self.cells and _lingers(argv):
                found[cell] = pid
        return address, found

    def _record(self, address: str) -> None:
        """Where the spawned workerds listen and their pids, for a resume (`_lingering`)."""
        if self.state_file is None or not self.spawn or self.workers is not None:
            return
        pids = {str(cell): p.pid for cell, p in enumerate(self.procs)}
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"address": address, "pids": pids}))
        os.replace(tmp, self.state_file)

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
        if self.hand_off and self.workers is None and (self.linger_s or not self.spawn):
            # A stop for a restart: the workerds stay up for the resume, their weights kept.
            log.info("%d workerd(s) left running for the resume", len(self.nodes))
            self.nodes.clear()
            self.procs.clear()
        for node in list(self.nodes):
            if self.link.nodes.get(node) and self.link.nodes[node].alive:
                try:
                    await self.link.call(node, wire.Shutdown(), timeout=5)
                except Exception as e:  # noqa: BLE001 - escalated to terminate/kill below
                    log.warning("shutdown of %s: %s", node, e)
        for p in self.procs:
            try:
                await asyncio.wait_for(p.wait(), 10)
            except TimeoutError:
                p.kill()
                await asyncio.wait_for(p.wait(), 10)
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


class Lingering:
    """A workerd an earlier coordinator of the run spawned, still running at the resume that
    takes it back: not this process's child, so it is waited for and killed by its pid."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    async def wait(self) -> int | None:
        while alive(self.pid):
            await asyncio.sleep(0.1)  # no exit status to wait on: it is not our child
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited and not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] not in ("Z", "X")


def _lingers(argv: list[bytes]) -> bool:
    """Whether a workerd's command line asks it to wait for a resume (--linger S, S > 0): one
    without ends with its coordinator, and may still be ending when the resume looks."""
    try:
        return float(argv[argv.index(b"--linger") + 1]) > 0
    except (ValueError, IndexError):
        return False

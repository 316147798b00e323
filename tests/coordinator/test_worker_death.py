"""A worker killed with SIGKILL mid-rollout: detected by its silence, its requests rerouted
(no harness sees an error), its cell excluded, the run finishes its steps, the dead cell is
reported; a worker that registers for the dead cell rejoins as a rollout cell."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.link import WorkerLink
from gyre.coordinator.local import LocalCluster
from gyre.coordinator.main import Coordinator
from gyre.workerd import wire
from tests.coordinator.scripted import write_tasks

HERE = Path(__file__).parent


def config(tiny_dir, tmp_path, **kw) -> CoordinatorConfig:
    tasks = write_tasks(tmp_path / "tasks.jsonl", 4)
    return CoordinatorConfig(run_dir=tmp_path / "run", model_dir=tiny_dir, cells=2, groups_per_step=2,
                             group_size=4, min_valid=1, harness=(sys.executable, str(HERE / "_harness.py")),
                             tasks_path=tasks, worker_timeout_s=2.0, default_max_tokens=48, seed=2, **kw)


def kill_cell_on_first_chunk(monkeypatch, coord: Coordinator, cell: int, after: asyncio.Event) -> list[str]:
    """SIGKILL cell `cell`'s workerd as soon as it has streamed one token of a request."""
    killed: list[str] = []
    generate = WorkerLink.generate

    async def generate_and_kill(self, node, msg, tensors=None, on_frames=None):
        async for chunk in generate(self, node, msg, tensors, on_frames=on_frames):
            yield chunk
            if not killed and node == coord.cells.nodes[cell]:
                killed.append(msg.rid)
                os.kill(coord.cluster.procs[cell].pid, signal.SIGKILL)
                after.set()

    monkeypatch.setattr(WorkerLink, "generate", generate_and_kill)
    return killed


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["colocate", "elastic"])
async def test_sigkill_mid_rollout_loses_nothing(tiny_dir, tmp_path, monkeypatch, policy):
    cfg = config(tiny_dir, tmp_path, steps=2, policy=policy)
    coord = Coordinator(cfg)
    killed = kill_cell_on_first_chunk(monkeypatch, coord, 1, asyncio.Event())
    reports = await coord.run()
    assert killed and len(reports) == 2  # the run finished its steps on the surviving cell
    lines = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    execs = [x for x in lines if x["event"] == "execution"]
    assert execs and {e["status"] for e in execs} <= {"completed", "cancelled"}  # no harness saw an error
    assert all(e["valid"] for e in execs if e["status"] == "completed")
    calls = [json.loads(x) for f in (cfg.run_dir / "executions").glob("*/calls.jsonl")
             for x in f.read_text().splitlines()]
    assert calls and {c["status"] for c in calls} == {"ok"}
    assert coord.proxy.backend.reroutes >= 1  # the killed request continued elsewhere
    (dead,) = [x for x in lines if x["event"] == "worker_dead"]
    assert dead["cell"] == 1
    (summary,) = [x for x in lines if x["event"] == "summary"]
    assert summary["dead_cells"] == [1]
    steps = [x for x in lines if x["event"] == "step"]
    assert all(s["cells_training"] == 1 for s in steps)  # the dead cell never trained
    assert coord.status()["cells"][1]["alive"] is False


class Watched(Coordinator):
    """Holds the run open until the dead cell has rejoined (no timing assumptions)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.died, self.rejoined, self.spawned = asyncio.Event(), asyncio.Event(), []

    async def tick(self) -> bool:
        done = await super().tick()  # its first act is the cells' health watch
        if 1 in self.cells.dead and not self.died.is_set():
            self.died.set()
            self.spawned.append(asyncio.ensure_future(asyncio.create_subprocess_exec(
                sys.executable, "-m", "gyre.cli", "workerd", "--coordinator", self.link.address, "--cell", "1",
                "--node-id", "replacement-1", "--heartbeat", "0.5", "--parent-pid", str(os.getpid()),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)))
        if self.died.is_set() and 1 not in self.cells.dead:
            self.rejoined.set()
        return done and self.rejoined.is_set()


@pytest.mark.timeout(300)
async def test_a_replacement_worker_rejoins_the_dead_cell(tiny_dir, tmp_path, monkeypatch):
    cfg = config(tiny_dir, tmp_path, steps=2, policy="elastic")
    coord = Watched(cfg)
    kill_cell_on_first_chunk(monkeypatch, coord, 1, asyncio.Event())
    try:
        reports = await coord.run()
    finally:
        for t in coord.spawned:
            proc = await t
            await proc.wait()  # told to shut down with the cluster... or gone with its parent
    assert len(reports) == 2 and coord.rejoined.is_set()
    lines = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    (rejoin,) = [x for x in lines if x["event"] == "worker_rejoined"]
    assert rejoin["cell"] == 1 and rejoin["node"] == "replacement-1"
    (summary,) = [x for x in lines if x["event"] == "summary"]
    assert summary["dead_cells"] == [] and summary["rejoined_cells"] == [1]
    assert coord.cells.nodes[1] == "replacement-1" and coord.cells.roles[1] == "rollout"
    execs = [x for x in lines if x["event"] == "execution"]
    assert {e["status"] for e in execs} <= {"completed", "cancelled"}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
async def test_external_workers_started_by_hand(tiny_dir, tmp_path):
    """workers = external: the coordinator spawns nothing and waits for the topology; two
    `gyre workerd` processes started by hand (no --cell: assigned) register and run it."""
    address = f"tcp://127.0.0.1:{free_port()}"
    cfg = config(tiny_dir, tmp_path, steps=1, policy="colocate", workers="external", address=address,
                 topology_timeout_s=120)
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gyre.cli", "workerd", "--coordinator", address, "--node-id", f"hand-{i}",
        "--heartbeat", "0.5", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        for i in range(2)]
    try:
        reports = await Coordinator(cfg).run()
    finally:
        codes = [await asyncio.wait_for(p.wait(), 60) for p in procs]
    assert len(reports) == 1 and reports[0].cells_training == 2
    assert codes == [0, 0]  # told to shut down at the end, exited cleanly
    assert not list(cfg.run_dir.glob("logs/workerd-*.log"))  # nothing was spawned here


def test_external_workers_need_a_fixed_address(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="needs a fixed address"):
        config(tiny_dir, tmp_path, workers="external")
    with pytest.raises(ValueError, match="workers must be one of local, inproc, external"):
        config(tiny_dir, tmp_path, workers="remote")


class Stalled(Coordinator):
    """Cell 1's workerd is stopped (SIGSTOP) mid-rollout and continued once declared dead:
    its late heartbeats must not revive it; it is asked to register again and rejoins."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.continued, self.rejoined = False, asyncio.Event()

    async def tick(self) -> bool:
        done = await super().tick()  # its first act is the cells' health watch
        if 1 in self.cells.dead and not self.continued:
            self.continued = True
            assert self.link.nodes[self.cells.nodes[1]].alive is False
            os.kill(self.cluster.procs[1].pid, signal.SIGCONT)
        if self.continued and 1 not in self.cells.dead:
            self.rejoined.set()
        return done and self.rejoined.is_set()


@pytest.mark.timeout(300)
async def test_a_stalled_worker_is_declared_dead_and_rejoins_after_registering_again(tiny_dir, tmp_path,
                                                                                     monkeypatch):
    cfg = config(tiny_dir, tmp_path, steps=2, policy="elastic")
    coord = Stalled(cfg)
    stopped: list[str] = []
    generate = WorkerLink.generate

    async def generate_and_stop(self, node, msg, tensors=None, on_frames=None):
        async for chunk in generate(self, node, msg, tensors, on_frames=on_frames):
            yield chunk
            if not stopped and node == coord.cells.nodes[1]:
                stopped.append(msg.rid)
                os.kill(coord.cluster.procs[1].pid, signal.SIGSTOP)

    monkeypatch.setattr(WorkerLink, "generate", generate_and_stop)
    reports = await coord.run()
    assert stopped and len(reports) == 2 and coord.rejoined.is_set()
    lines = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["cell"] for x in lines if x["event"] == "worker_dead"] == [1]
    (rejoin,) = [x for x in lines if x["event"] == "worker_rejoined"]
    assert rejoin["node"] == "local-1"  # the same process, registered again
    assert {x["status"] for x in lines if x["event"] == "execution"} <= {"completed", "cancelled"}


@pytest.mark.timeout(180)
async def test_a_second_worker_for_a_held_name_or_cell_is_not_let_in(tiny_dir):
    """Two more `gyre workerd` processes while cell 0's is up: one under its node id (ZeroMQ
    never reads a connection claiming a connected id), one under a name of its own for the
    same cell (refused). Neither is welcomed, nothing is kept of them, the first serves on."""
    async with LocalCluster(tiny_dir, cells=1, roles=("rollout",)) as cluster:
        link, node = cluster.link, cluster.node_of_cell(0)
        procs = [await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gyre.cli", "workerd", "--coordinator", link.address, "--cell", "0",
            "--node-id", name, "--welcome-timeout", "3", stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE) for name in (node, "second-0")]
        errors = [(await asyncio.wait_for(p.communicate(), 60))[1] for p in procs]
        assert [p.returncode for p in procs] == [1, 1] and all(b"HandshakeTimeout" in e for e in errors)
        assert list(link.nodes) == [node] and link.nodes[node].alive
        assert link.dropped == {"registration refused": 1}  # second-0's; the other was never read
        assert [type(e) for e in cluster.events] == [wire.Register, wire.Ready, wire.Register]
        msg = wire.Generate(rid="a", prompt_ids=list(b"hi"), max_new_tokens=4)
        assert sum(len(c.token_ids) for c in [c async for c in link.generate(node, msg)]) == 4

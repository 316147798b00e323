"""stack.py: the rollout stack and the execution stack, built here for every command.

The rollout stack is the workers, the routing table and the proxy in front of them: `gyre
up` runs every cell of its config (`run_workers`), and `gyre serve`, `serve --harness`,
`tasks run` and `eval` one local rollout cell (`serving_worker`). The execution stack is
the sandbox hosts and the launcher that runs executions in them through that proxy. Each
is an async context manager that takes down what it built, in reverse, however its block
ends: the proxy before the workers it routes to, the launcher's executions and then the
sandboxes before the proxy their harnesses call. Not what runs inside them: the RL loop
(main.py), one harness run or a served client (serve.py), task runs (taskrun.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.launcher import Launcher, LaunchSpec
from gyre.coordinator.local import WORKERS_FILE, LocalCluster
from gyre.coordinator.preflight import start_proxy
from gyre.coordinator.routing import LinkBackend, RoutingTable
from gyre.coordinator.rundir import run_id
from gyre.coordinator.sandbox.pool import Sandboxes, open_sandboxes
from gyre.proxy.chat import ChatTokenizer
from gyre.proxy.server import ProxyServer
from gyre.proxy.serving import ProxyConfig

# Every execution a command starts is scored by this when its task names no evaluator.
DEFAULT_EVALUATOR = {"type": "similarity"}


def run_workers(c: CoordinatorConfig, roles: Sequence[str], workers=None, *,
                resume_version: int | None = None) -> LocalCluster:
    """The cells of a run: `c.cells` workers, started (or, with workers = "external",
    awaited) when the rollout stack is entered, each welcomed with its role in `roles`
    and the run's engine and trainer specs; `workers`: the in-process ones of
    workers = "inproc" (gyre.workerd.inproc.InprocWorkers), else None. A resume at
    `resume_version`: workerds that outlived the earlier coordinator keep their backends
    if their trainer is at that version (wire.Welcome.run, .version)."""
    return LocalCluster(c.model_dir, cells=c.cells, roles=tuple(roles), address=c.address,
                        run_id=run_id(c.run_dir), resume_version=resume_version,
                        linger_s=c.worker_linger_s if c.workers == "local" else 0.0,
                        state_file=c.run_dir / WORKERS_FILE,
                        trainer=c.trainer_spec(), engine=c.engine_spec(), log_dir=c.run_dir / "logs",
                        backends=(c.engine_backend, c.trainer_backend), keys_dir=c.keys_dir,
                        spawn=c.workers != "external", workers=workers, call_timeout_s=c.worker_call_timeout_s,
                        start_timeout_s=c.topology_timeout_s if c.workers == "external" else 120.0)


def run_routes(c: CoordinatorConfig) -> RoutingTable:
    """The run's routes to its rollout cells, by its routing policy and load bound."""
    return RoutingTable(policy=c.routing, balance_abs=c.route_balance_abs, balance_rel=c.route_balance_rel)


def serving_worker(model_dir: Path, run_dir: Path) -> LocalCluster:
    """One local workerd serving `model_dir`'s rollouts (serve, tasks run, eval); its log in
    RUN_DIR/logs/."""
    return LocalCluster(model_dir, cells=1, roles=("rollout",), log_dir=run_dir / "logs")


@dataclass
class Rollout:
    """An entered rollout stack: the workers, the nodes of its cells (cell i's is nodes[i]),
    the routes to them and the proxy, listening."""

    cluster: LocalCluster
    nodes: list[str]
    table: RoutingTable
    proxy: ProxyServer

    @property
    def link(self):
        return self.cluster.link


@asynccontextmanager
async def rollout_stack(cluster: LocalCluster, serving: ProxyConfig, *, run_dir: Path,
                        table: RoutingTable | None = None) -> AsyncIterator[Rollout]:
    """Start `cluster`'s workers (ready, or ClusterStartError), route to its cells (those
    welcomed as rollout open, the others closed) through `table` (default: affine routes
    with their defaults), and start the proxy with `serving` (a port taken since the
    preflight: PortInUse). Stops the proxy, then the workers."""
    async with cluster:
        nodes = [cluster.node_of_cell(i) for i in range(cluster.cells)]
        table = table if table is not None else RoutingTable()
        table.set_nodes(nodes)
        for node in nodes:
            if cluster.nodes[node].role != "rollout":
                table.close(node)
        proxy = ProxyServer(ChatTokenizer(cluster.model_dir), LinkBackend(cluster.link, table), serving,
                            run_dir=run_dir)
        await start_proxy(proxy)
        try:
            yield Rollout(cluster, nodes, table, proxy)
        finally:
            await proxy.stop()


@dataclass
class Executor:
    """An entered execution stack: the launcher and the sandbox hosts it runs executions on."""

    launcher: Launcher
    sandboxes: Sandboxes


@asynccontextmanager
async def execution_stack(proxy: ProxyServer, spec: LaunchSpec, *, run_dir: Path,
                          config: CoordinatorConfig | None = None, sandbox: str | None = None,
                          sandbox_url: str | None = None,
                          remote_relay: Callable | None = None) -> AsyncIterator[Executor]:
    """Open the sandbox hosts (a run's `config`, or the one host `sandbox` at `sandbox_url`;
    orphans of dead runs reaped; SandboxError when none answers) and a launcher running
    `spec`'s executions in them through `proxy`. Stops every execution still running, then
    closes the hosts."""
    if config is not None:
        sandboxes = await open_sandboxes(config)
    else:
        sandboxes = await open_sandboxes(sandbox=sandbox or "process", url=sandbox_url, run_dir=run_dir)
    try:
        launcher = Launcher(proxy, run_dir, spec, default_evaluator=DEFAULT_EVALUATOR, pool=sandboxes.pool,
                            owner=sandboxes.owner, remote_relay=remote_relay, adopted=sandboxes.adopted,
                            handed_off=sandboxes.handed_off)
        try:
            yield Executor(launcher, sandboxes)
        finally:
            await launcher.stop_all()
    finally:
        await sandboxes.close()

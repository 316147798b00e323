"""pool.py: a run's sandbox hosts opened (orphans of dead runs reaped on each) and closed.

`open_sandboxes` makes the run's backend once per host ([[sandbox_hosts]], or the one local
host), opens and reaps each, and starts the pool's health pings; `Sandboxes.sweep` reaps, once
a restarted coordinator has adopted what it could, what an earlier one left on its run
directory; `Sandboxes.close` reaps what this process left. Not the launcher (launcher.py runs
executions in them) and not the pool's host choice (hosts.py).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from gyre.coordinator.sandbox import SandboxBackend, SandboxError, make_backend, reaper
from gyre.coordinator.sandbox.hosts import PING_INTERVAL_S, PING_TIMEOUT_S, HostPool, SandboxHost, host_specs

log = logging.getLogger("gyre.coordinator")


@dataclass
class Sandboxes:
    """The run's opened sandbox hosts and this process's owner label; `close` reaps what it left."""

    pool: HostPool
    owner: str
    run_dir: Path | None = None
    adopted: set[str] = field(default_factory=set)  # executions this process took over (launcher.adopt)
    handed_off: set[str] = field(default_factory=set)  # left running at a stop for a restart (launcher.hand_off)

    async def sweep(self) -> int:
        """An earlier coordinator's sandboxes of this run directory that were not adopted
        (reaper.at_resume), removed: called once the resume has adopted what it could."""
        n = 0
        for host in self.pool.up:
            try:
                n += await reaper.reap(host.backend, reaper.at_resume(self.owner, self.run_dir, self.adopted),
                                       f"after the restart's adoptions ({host.name})")
            except SandboxError as e:
                log.warning("%s: an earlier coordinator's sandboxes not reaped: %s", host.name, e)
        return n

    @property
    def backend(self) -> SandboxBackend:
        return self.pool.hosts[0].backend  # every host is of the run's one kind

    async def close(self) -> None:
        await self.pool.stop_watching()
        for host in self.pool.hosts:
            if host.state == "up":
                try:
                    alive = reaper.at_shutdown(self.owner, self.run_dir, self.adopted, self.handed_off)
                    await reaper.reap(host.backend, alive, f"at shutdown ({host.name})")
                except SandboxError as e:
                    log.warning("%s: orphans not reaped at shutdown: %s", host.name, e)
            await host.backend.close()


async def open_sandboxes(c=None, *, sandbox: str | None = None, url: str | None = None,
                         run_dir: Path | None = None, hosts: list[dict] | None = None,
                         ping_interval_s: float = PING_INTERVAL_S, ping_timeout_s: float = PING_TIMEOUT_S) -> Sandboxes:
    """Open the run's sandbox hosts (config `c`, or the names given: one host, or `hosts` as
    [[sandbox_hosts]] tables) and reap the orphans of dead runs (and of an earlier process on
    this run directory) on each. A host that cannot be opened starts down; SandboxError when
    none can."""
    name = sandbox or (c.sandbox if c is not None else "process")
    specs = host_specs(hosts if hosts is not None else (c.sandbox_hosts if c is not None else ()))
    if not specs:
        specs = [{"name": "local", "url": url if url is not None else (c.sandbox_url if c is not None else None),
                  "max_concurrent": None, "node": None}]
    owner = secrets.token_hex(8)
    run_dir = run_dir or c.run_dir
    pool_hosts, errors = [], []
    for spec in specs:
        backend = make_backend(name, spec["url"])
        if spec["node"] is not None:
            backend.local = False  # its containers' namespaces are that node's to enter
        host = SandboxHost(spec["name"], backend, spec["max_concurrent"], spec["node"])
        pool_hosts.append(host)
        try:
            await backend.open()
            await reaper.reap(backend, reaper.at_startup(owner, run_dir), f"at start-up ({host.name})")
        except SandboxError as e:
            if len(specs) == 1:
                await backend.close()
                raise
            errors.append(f"{host.name}: {e}")
            host.state, host.why = "down", str(e)[:300]
            host.down.set()
            log.warning("sandbox host %s is down at start-up: %s", host.name, e)
        except BaseException:
            for h in pool_hosts:
                await h.backend.close()
            raise
    if len(errors) == len(specs):
        for h in pool_hosts:
            await h.backend.close()
        raise SandboxError("no sandbox host answers: " + "; ".join(errors))
    pool = HostPool(pool_hosts, ping_interval_s=ping_interval_s if pool_hosts[0].backend.needs_image else 0.0,
                    ping_timeout_s=ping_timeout_s)
    pool.start_watching()
    return Sandboxes(pool, owner, run_dir)

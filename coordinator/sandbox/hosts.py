"""hosts.py: several sandbox hosts, each a Docker-compatible engine with a concurrency cap.

A run's executions spread over its hosts: each goes to the up host with the fewest running
and building executions that is under its cap (`max_concurrent`), preferring a host that
already holds the task's image. A host is watched while the run lasts: every
`ping_interval_s` its engine is pinged; one that does not answer within `ping_timeout_s`
twice in a row is marked down, its executions are ended `aborted_infra` (the launcher
watches `down`), and no new one goes there until a later ping answers. The proxy-only
network of a container on the coordinator's own host is made by the coordinator
(workerd/netns.py); on another host by that node's `gyre workerd` (`node`), which binds the
listener in the container's namespace and relays to the coordinator's proxy. Not the
backends: docker_api.py talks to each engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from gyre.coordinator.sandbox.base import SandboxBackend, SandboxError

log = logging.getLogger("gyre.coordinator")
PING_INTERVAL_S = 5.0
PING_TIMEOUT_S = 10.0
MISSES_DOWN = 2  # pings in a row without an answer before a host is marked down


@dataclass(eq=False)
class SandboxHost:
    name: str
    backend: SandboxBackend
    max_concurrent: int | None = None  # None: no cap of its own (the rollout slots are the cap)
    node: str | None = None  # the workerd that makes the proxy-only network there; None: this host
    state: str = "up"  # up | down
    why: str = ""  # why it is down
    running: int = 0  # executions holding a sandbox (or about to) there
    building: int = 0  # image builds in progress there
    failed: int = 0  # executions that ended aborted_infra there
    misses: int = 0
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set while down

    @property
    def load(self) -> int:
        return self.running

    @property
    def full(self) -> bool:
        return self.max_concurrent is not None and self.running >= self.max_concurrent

    def row(self) -> dict:
        return {"host": self.name, "state": self.state, "running": self.running, "building": self.building,
                "failed": self.failed, "max_concurrent": self.max_concurrent, "why": self.why}


class HostPool:
    def __init__(self, hosts: list[SandboxHost], *, ping_interval_s: float = PING_INTERVAL_S,
                 ping_timeout_s: float = PING_TIMEOUT_S):
        if not hosts:
            raise SandboxError("a sandbox pool needs at least one host")
        names = [h.name for h in hosts]
        if len(set(names)) != len(names):
            raise SandboxError(f"sandbox host names must be unique, got {names}")
        self.hosts = hosts
        self.ping_interval_s = ping_interval_s
        self.ping_timeout_s = ping_timeout_s
        self._watch: asyncio.Task | None = None

    @property
    def up(self) -> list[SandboxHost]:
        return [h for h in self.hosts if h.state == "up"]

    def choose(self, prefer: set[str] = frozenset()) -> SandboxHost | None:
        """The up host under its cap with the least load (one named in `prefer` first)."""
        free = [h for h in self.up if not h.full]
        if not free:
            return None
        return min(free, key=lambda h: (h.name not in prefer, h.load, self.hosts.index(h)))

    def mark_down(self, host: SandboxHost, why: str) -> None:
        if host.state == "down":
            return
        host.state, host.why = "down", why
        host.down.set()
        log.warning("sandbox host %s is down: %s (its executions end aborted_infra)", host.name, why)

    def mark_up(self, host: SandboxHost) -> None:
        if host.state == "up":
            return
        host.state, host.why, host.misses = "up", "", 0
        host.down.clear()
        log.warning("sandbox host %s answers again", host.name)

    async def ping(self, host: SandboxHost) -> bool:
        try:
            await asyncio.wait_for(host.backend.ping(self.ping_timeout_s), self.ping_timeout_s + 1.0)
        except (TimeoutError, SandboxError, OSError) as e:
            host.misses += 1
            if host.misses >= MISSES_DOWN:
                detail = f": {e}" if str(e) else f" after {self.ping_timeout_s:g} s"
                self.mark_down(host, f"no answer to {host.misses} pings ({type(e).__name__}{detail})"[:300])
            return False
        host.misses = 0
        self.mark_up(host)
        return True

    def start_watching(self) -> None:
        if self._watch is None and len(self.hosts) > 0 and self.ping_interval_s > 0:
            self._watch = asyncio.ensure_future(self._watch_loop())

    async def _watch_loop(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.gather(*(self.ping(h) for h in self.hosts))
            await asyncio.sleep(max(0.0, self.ping_interval_s - (time.monotonic() - t)))

    async def stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
            self._watch = None

    def rows(self) -> list[dict]:
        return [h.row() for h in self.hosts]


HOST_KEYS = {"name", "url", "max_concurrent", "node"}


def host_specs(raw) -> list[dict]:
    """The run config's `sandbox_hosts` ([[sandbox_hosts]] tables: name, url, max_concurrent,
    node), checked; ValueError naming the entry and key."""
    out, names = [], set()
    for i, entry in enumerate(raw or ()):
        where = f"sandbox_hosts[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a table (name, url, max_concurrent, node), got {entry!r}")
        unknown = set(entry) - HOST_KEYS
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (known: name, url, "
                             "max_concurrent, node)")
        name, url = entry.get("name"), entry.get("url")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name must be a non-empty string, got {name!r}")
        if name in names:
            raise ValueError(f"{where}.name {name!r} is given twice")
        names.add(name)
        if not isinstance(url, str) or not url.startswith(("unix://", "tcp://", "http://", "https://", "ssh://")):
            raise ValueError(f"{where}.url must be an engine endpoint (unix://, tcp://, http(s)://, ssh://), "
                             f"got {url!r}")
        cap = entry.get("max_concurrent")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"{where}.max_concurrent must be an integer >= 1, got {cap!r}")
        node = entry.get("node")
        if node is not None and (not isinstance(node, str) or not node):
            raise ValueError(f"{where}.node must be a workerd's node id, got {node!r}")
        out.append({"name": name, "url": url, "max_concurrent": cap, "node": node})
    return out

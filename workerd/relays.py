"""relays.py: a node's proxy-only network for sandboxes the coordinator cannot reach itself.

A container on another host than the coordinator's has its network namespace there, where the
coordinator cannot `setns`. The node's workerd (root, on that host) does it instead: the
coordinator's `open_relay` call names the container's pid (in this host's pid namespace)
and the proxy's port; the workerd binds a listener inside that namespace (netns.py, on a
thread of its own) and relays each connection to the proxy on the coordinator's address,
at most `max_connections` in flight per sandbox (ProxyRelay's cap: a sandbox flooding its
relay spends none of this daemon's fds past it).
The relays run on one asyncio loop in a thread of their own, apart from the engine loop.
Not the coordinator's relay: that one runs in the coordinator's own loop.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from urllib.parse import urlsplit

from gyre.workerd.netns import MAX_RELAY_CONNECTIONS, SANDBOX_PROXY_PORT, ProxyRelay

CALL_TIMEOUT_S = 30.0


class RelayService:
    def __init__(self, coordinator: str, max_connections: int = MAX_RELAY_CONNECTIONS):
        self.host = urlsplit(coordinator).hostname or "127.0.0.1"  # the proxy runs with the coordinator
        self.max_connections = max_connections  # in flight per sandbox
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._relays: dict[int, ProxyRelay] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="gyre-workerd-relays",
                                                daemon=True)
                self._thread.start()
            return self._loop

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._ensure_loop()).result(CALL_TIMEOUT_S)

    def open(self, pid: int, proxy_port: int, proxy_host: str | None = None,
             port: int = SANDBOX_PROXY_PORT) -> dict:
        """A listener in pid's network namespace relaying to the proxy; {"relay", "port"}."""
        relay = ProxyRelay(proxy_host or self.host, int(proxy_port), self.max_connections)
        bound = self._run(relay.start(int(pid), int(port)))
        rid = next(self._ids)
        self._relays[rid] = relay
        return {"relay": rid, "port": bound}

    def close(self, relay: int) -> dict:
        r = self._relays.pop(int(relay), None)
        if r is not None:
            self._run(r.close())
        return {"closed": r is not None}

    def close_all(self) -> None:
        for rid in list(self._relays):
            self.close(rid)
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is not None:  # stopped, then closed (its selector and self-pipe go with it)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(CALL_TIMEOUT_S)
            if not thread.is_alive():
                loop.close()

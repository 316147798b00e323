"""What one sandbox can do to the coordinator's file descriptors through its proxy relay
(issue 36, finding 5): a flood of connections held open inside one network namespace, and
connections the proxy times out. Real namespaces (`unshare --net`, root), the real proxy on
127.0.0.1, clients inside the namespace in a subprocess (`nsenter`), so the fds counted in
/proc/self/fd are the relay's and the proxy's alone. Waits are on the clients' reports and on
a condition with a deadline, never on a sleep. Skips where namespaces cannot be made.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from contextlib import asynccontextmanager

import pytest

from gyre.proxy.server import ProxyConfig, ProxyServer
from gyre.workerd.netns import MAX_RELAY_CONNECTIONS, ProxyRelay
from gyre.workerd.relays import RelayService
from tests.scripted import ScriptedEngine
from tests.support import ThreadEngineBackend

FLOOD = 3000  # held connections from one sandbox: 3 fds each here (relay in and out, proxy) unless capped
SLACK = 48  # fds the loop, the subprocess pipes and the victim's connections may add

# Runs inside a namespace. "hold N": N connections, each sends one keep-alive request, and
# reports how many were answered and how many closed by the relay; "idle N": N connections,
# half silent, half after one keep-alive request, reports when the far side closed them all;
# both then hold every socket until stdin closes. "calls N KEY": N calls, a fresh connection each.
INSIDE = r"""
import http.client, json, selectors, socket, sys, time
mode, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
if mode == "calls":
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    ok, failed = 0, []
    for _ in range(n):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            c.request("POST", "/v1/chat/completions", body,
                      {"Authorization": "Bearer " + sys.argv[4], "Content-Type": "application/json"})
            r = c.getresponse()
            text = r.read().decode()
            if r.status == 200 and "Done." in text:
                ok += 1
            else:
                failed.append(f"{r.status} {text[:200]}")
        except OSError as e:
            failed.append(repr(e))
        finally:
            c.close()
    print(json.dumps({"ok": ok, "failed": failed}), flush=True)
    sys.exit()
sel, socks = selectors.DefaultSelector(), []  # every socket kept open here until stdin closes
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    socks.append(s)
    s.setblocking(False)
    sel.register(s, selectors.EVENT_READ, bytearray())
    if mode == "hold" or i % 2:
        try:
            s.send(HEALTH)  # at once: a held connection is answered long before the proxy's deadlines
        except OSError:
            pass  # reset already: seen below
closed = 0
answered, deadline = 0, time.monotonic() + 120
while sel.get_map() and time.monotonic() < deadline:
    for key, _ in sel.select(1.0):
        try:
            data = key.fileobj.recv(65536)
        except BlockingIOError:
            continue
        except OSError:
            data = b""
        if data:
            key.data.extend(data)
            if mode == "hold" and key.data.startswith(b"HTTP/1.1 200 "):
                answered += 1  # held open now: a keep-alive connection through relay and proxy
                sel.unregister(key.fileobj)
            continue
        closed += 1
        sel.unregister(key.fileobj)
print(json.dumps({"answered": answered, "closed": closed, "pending": len(sel.get_map())}), flush=True)
sys.stdin.read()
"""


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def eventually(condition, deadline_s: float) -> bool:
    """Whether `condition()` holds within the deadline (checked as the loop turns)."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.02)
    return True


@pytest.fixture
def netns():
    """Makes processes in network namespaces of their own, loopback up; returns their pids."""
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "nsenter", "ip")):
        pytest.skip("network namespaces need root, unshare, nsenter and ip")
    procs = []

    def make() -> int:
        p = subprocess.Popen(["unshare", "--net", "sh", "-c", "ip link set lo up && echo up && exec sleep 600"],
                             stdout=subprocess.PIPE, text=True)
        procs.append(p)
        if p.stdout.readline().strip() != "up":
            pytest.skip("cannot make a network namespace here")
        return p.pid

    try:
        yield make
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()


@asynccontextmanager
async def live_proxy(tok, tmp_path, **config):
    backend = ThreadEngineBackend(ScriptedEngine(tok), sampling_cls=lambda **kw: kw)
    server = ProxyServer(tok, backend, ProxyConfig(**config), run_dir=tmp_path / "run")
    await server.start()
    try:
        yield server, int(server.base_url.rsplit(":", 1)[1])
    finally:
        await server.stop()
        backend.close()


@asynccontextmanager
async def inside(pid: int, *args: object):
    """INSIDE run in pid's network namespace; yields the process (stdin open until the end)."""
    proc = await asyncio.create_subprocess_exec(
        "nsenter", f"--net=/proc/{pid}/ns/net", sys.executable, "-c", INSIDE, *map(str, args),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 60)


async def report(proc) -> dict:
    line = await asyncio.wait_for(proc.stdout.readline(), 180)
    assert line, "the client inside the namespace died"
    return json.loads(line)


async def calls(pid: int, port: int, n: int, key: str) -> dict:
    async with inside(pid, "calls", port, n, key) as proc:
        return await report(proc)


async def test_a_flood_of_held_connections_is_capped_per_sandbox_and_a_neighbour_is_served(
        chat_tokenizer, tmp_path, netns, caplog):
    """3,000 connections held open from one sandbox: its relay holds at most its cap (the
    rest are closed at once, logged once), so the coordinator's fds stay bounded; a
    neighbour's calls through its own relay all succeed, during the flood and after; once
    the flood lets go, its own sandbox is served again."""
    async with live_proxy(chat_tokenizer, tmp_path) as (server, port):
        victim = server.register("victim")
        flooder_ns, victim_ns = netns(), netns()
        flood_relay, victim_relay = ProxyRelay("127.0.0.1", port), ProxyRelay("127.0.0.1", port)
        try:
            flood_port, victim_port = await flood_relay.start(flooder_ns), await victim_relay.start(victim_ns)
            before = fds()
            t0 = time.monotonic()
            with caplog.at_level(logging.WARNING):
                async with inside(flooder_ns, "hold", flood_port, FLOOD) as flood:
                    held = await report(flood)
                    during = fds() - before
                    victim_calls = await calls(victim_ns, victim_port, 20, victim.key)
            elapsed = time.monotonic() - t0
            assert held["pending"] == 0 and held["answered"] + held["closed"] == FLOOD
            assert 0 < held["answered"] <= MAX_RELAY_CONNECTIONS, held
            assert during <= 3 * MAX_RELAY_CONNECTIONS + SLACK, f"{during} fds for {held['answered']} held"
            assert victim_calls == {"ok": 20, "failed": []}
            refusals = [r for r in caplog.records if "sandbox relay" in r.getMessage() and "refused" in r.getMessage()]
            # once per 10 s interval with a count, not once per connection
            assert 1 <= len(refusals) <= 1 + elapsed // 10, [r.getMessage() for r in refusals]
            assert 0 < flood_relay.refused.total <= held["closed"]  # the rest: the proxy's deadlines, if any
            assert await eventually(lambda: fds() <= before + SLACK, 30), fds() - before
            assert await calls(flooder_ns, flood_port, 5, victim.key) == {"ok": 5, "failed": []}
        finally:
            await flood_relay.close()
            await victim_relay.close()


async def test_a_connection_the_proxy_closes_is_closed_inside_too(chat_tokenizer, tmp_path, netns):
    """The proxy times out connections that never send headers and idle keep-alive ones; the
    relay then closes the inside end too, though the client inside keeps its socket: no fd
    of the pair stays with the coordinator."""
    async with live_proxy(chat_tokenizer, tmp_path, header_timeout_s=0.5, keepalive_timeout_s=0.5) as (_, port):
        pid = netns()
        relay = ProxyRelay("127.0.0.1", port)
        try:
            relay_port = await relay.start(pid)
            before = fds()
            async with inside(pid, "idle", relay_port, 100) as idle:
                seen = await report(idle)
                assert seen == {"answered": 0, "closed": 100, "pending": 0}  # the far side closed each one
                # the client still holds all 100: only the relay closing its ends frees the pairs' fds
                assert await eventually(lambda: fds() <= before + 8, 10), f"{fds() - before} fds still held"
        finally:
            await relay.close()


async def test_the_workerd_relay_is_capped_per_sandbox_too(chat_tokenizer, tmp_path, netns):
    """A node's workerd relays for sandboxes on its host with the same relay and its cap."""
    async with live_proxy(chat_tokenizer, tmp_path) as (_, port):
        pid = netns()
        service = RelayService("tcp://127.0.0.1:1", max_connections=8)
        try:
            opened = await asyncio.to_thread(service.open, pid, port)
            async with inside(pid, "hold", opened["port"], 50) as flood:
                held = await report(flood)
            assert held == {"answered": 8, "closed": 42, "pending": 0}
        finally:
            await asyncio.to_thread(service.close_all)

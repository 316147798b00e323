"""netns.py: the proxy-only network: a listener inside a sandbox's network namespace.

A sandbox runs with no network at all. `bind_in_netns` opens a TCP socket in the namespace
of a process inside it (`setns` on a short-lived thread of this process, which then returns
to the host's namespace; the socket stays where it was made), and `ProxyRelay` serves it on
an event loop (the coordinator's, for a sandbox on its host; a node's workerd's, relays.py,
for one on the node's host), relaying every connection to the proxy on the host's
loopback. No extra process and nothing inside the image; the harness is told
`http://127.0.0.1:PORT`, and from inside nothing else answers: no other host port, no other
address, no DNS. One relay per execution, holding at most MAX_RELAY_CONNECTIONS connections
in flight, each closed on both sides as soon as the proxy's side ends (issue 36: a sandbox
holding thousands of connections used to take the coordinator's fds). Linux only, and it
needs CAP_SYS_ADMIN (root). Here in workerd/, beside relays.py: the coordinator may import
it, a light module (standard library only; tests/test_layering.py). Its failures are
`RelayError`s; the coordinator's launcher reports them as its sandbox errors.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import socket
import threading
import time

from gyre.workerd.wire import GyreError

log = logging.getLogger("gyre.coordinator")  # where the relays' warnings have always gone, a node's too

CLONE_NEWNET = 0x40000000
SANDBOX_PROXY_PORT = 47600  # the proxy's port inside every sandbox (each has its own namespace)
# Connections in flight through one sandbox's relay (each is 2 fds here, 1 in the proxy): a
# harness needs a handful; a sandbox holding thousands must not exhaust the coordinator's fds.
MAX_RELAY_CONNECTIONS = 256
_CONNECT_S = 10.0  # to reach the proxy
_FLUSH_S = 10.0  # for what a closed side still has buffered
_REPORT_EVERY_S = 10.0
_libc = None


class RelayError(GyreError):
    """A relay that cannot be made: no listener in the namespace, a bad connection cap."""


def _setns(fd: int) -> None:
    if hasattr(os, "setns"):  # Python 3.12
        os.setns(fd, CLONE_NEWNET)
        return
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def bind_in_netns(pid: int, host: str = "127.0.0.1", port: int = SANDBOX_PROXY_PORT) -> socket.socket:
    """A listening, non-blocking TCP socket bound to host:port in the network namespace of `pid`."""
    out: dict = {}

    def work() -> None:
        own = target = -1
        try:
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
            _setns(target)
            try:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind((host, port))
                    sock.listen(256)
                    sock.setblocking(False)
                except BaseException:
                    sock.close()
                    raise
                out["sock"] = sock
            finally:
                try:
                    _setns(own)
                except OSError as e:  # this thread is lost to the host; it ends right here
                    out.setdefault("error", e)
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            out.setdefault("error", e)
        finally:
            for fd in (own, target):
                if fd >= 0:
                    os.close(fd)

    # A thread of its own: setns changes only the calling thread, which never serves anything else.
    t = threading.Thread(target=work, name=f"gyre-setns-{pid}", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        if "sock" in out:
            out["sock"].close()
        e = out["error"]
        raise RelayError(f"cannot listen for the proxy in the network namespace of pid {pid}: "
                           f"{type(e).__name__}: {e}")
    return out["sock"]


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Copies reader to writer until the reader's end; True for a clean end of stream (then the
    writer is half-closed, so an answer can still come back), False for a broken side."""
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, OSError):
        return False
    try:
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        return False
    return True


async def _close(writer: asyncio.StreamWriter) -> None:
    """Closes one side, letting what is buffered go out for a while; a peer that never reads
    it is cut, so a closed pair never keeps its fd."""
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), _FLUSH_S)
    except (TimeoutError, ConnectionError, OSError):
        writer.transport.abort()
    except asyncio.CancelledError:
        writer.transport.abort()
        raise


class _Tally:
    """A recurring event of one relay, logged once per interval with its count, never once
    per connection (a flood would flood the log too)."""

    def __init__(self, message: str):
        self.message, self.total, self._count, self._at = message, 0, 0, None

    def note(self, *args: object) -> None:
        self.total += 1
        self._count += 1
        now = time.monotonic()
        if self._at is None or now - self._at >= _REPORT_EVERY_S:
            since = "" if self._at is None else f" ({self._count} in the last {now - self._at:.0f} s)"
            log.warning(self.message + since, *args)
            self._at, self._count = now, 0


class ProxyRelay:
    """Relays connections accepted inside one sandbox to the proxy at (host, port).

    At most `max_connections` in flight: past it a new connection is reset at once (counted,
    logged once per interval), so one sandbox cannot spend the coordinator's fds, whatever
    the proxy's own limits. A pair ends when the proxy's side ends (it answered and closed,
    timed the connection out, or refused it) or either side breaks; the inside side ending
    cleanly half-closes the proxy's, whose answer still comes back, and the proxy's deadlines
    bound the rest."""

    def __init__(self, target_host: str, target_port: int, max_connections: int = MAX_RELAY_CONNECTIONS):
        if max_connections < 1:
            raise RelayError(f"the sandbox relay needs max_connections >= 1, not {max_connections}")
        self.target = (target_host, target_port)
        self.max_connections = max_connections
        self.server: asyncio.AbstractServer | None = None
        self.port: int | None = None
        self.pid: int | None = None
        self.refused = _Tally("sandbox relay (pid %s): connections refused: %d in flight, the limit per sandbox")
        self.unreachable = _Tally("sandbox relay: cannot reach the proxy at %s:%d: %s")
        self._conns: dict[asyncio.Task, list[asyncio.StreamWriter]] = {}

    async def start(self, pid: int, port: int = SANDBOX_PROXY_PORT) -> int:
        sock = await asyncio.to_thread(bind_in_netns, pid, "127.0.0.1", port)
        self.pid, self.port = pid, sock.getsockname()[1]
        self.server = await asyncio.start_server(self._handle, sock=sock)
        return self.port

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Counted before any await: a burst accepted in one loop turn is counted one by one.
        if len(self._conns) >= self.max_connections:
            self.refused.note(self.pid, len(self._conns))
            writer.transport.abort()  # a reset: nothing read, no fd kept, no lingering close
            return
        task = asyncio.current_task()
        sides = self._conns[task] = [writer]
        try:
            try:
                up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.target), _CONNECT_S)
            except (OSError, TimeoutError) as e:
                self.unreachable.note(*self.target, str(e) or type(e).__name__)
                return
            sides.append(up_writer)
            try:
                await _relay_pair(reader, writer, up_reader, up_writer)
            finally:
                await _close(up_writer)
        finally:
            try:
                await _close(writer)
            finally:
                self._conns.pop(task, None)

    async def close(self) -> None:
        """Stops listening and cuts every connection in flight."""
        if self.server is None:
            return
        self.server.close()
        for sides in list(self._conns.values()):
            for w in sides:
                w.transport.abort()
        if self._conns:
            _, late = await asyncio.wait(list(self._conns), timeout=_FLUSH_S)
            for t in late:
                t.cancel()
        self.server = None


async def _relay_pair(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      up_reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter) -> None:
    """Relays both ways until the pair is done: the proxy's side ended (whatever the inside
    does), or the inside side broke. A clean end from inside waits for the proxy's answer."""
    outward = asyncio.ensure_future(_pump(reader, up_writer))
    inward = asyncio.ensure_future(_pump(up_reader, writer))
    try:
        await asyncio.wait((outward, inward), return_when=asyncio.FIRST_COMPLETED)
        if not inward.done() and outward.result():
            await inward
    finally:
        for t in (outward, inward):
            t.cancel()
        await asyncio.gather(outward, inward, return_exceptions=True)

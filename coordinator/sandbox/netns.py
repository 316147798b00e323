"""netns.py: the proxy-only network: a listener inside a sandbox's network namespace.

A sandbox runs with no network at all. `bind_in_netns` opens a TCP socket in the namespace
of a process inside it (`setns` on a short-lived thread of this process, which then returns
to the host's namespace; the socket stays where it was made), and `ProxyRelay` serves it on
the coordinator's event loop, relaying every connection to the proxy on the host's
loopback. No extra process and nothing inside the image; the harness is told
`http://127.0.0.1:PORT`, and from inside nothing else answers: no other host port, no other
address, no DNS. One relay per execution. Linux only, and it needs CAP_SYS_ADMIN (root).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import socket
import threading

from gyre.coordinator.sandbox.base import SandboxError

log = logging.getLogger("gyre.coordinator")

CLONE_NEWNET = 0x40000000
SANDBOX_PROXY_PORT = 47600  # the proxy's port inside every sandbox (each has its own namespace)
_libc = None


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
        raise SandboxError(f"cannot listen for the proxy in the network namespace of pid {pid}: "
                           f"{type(e).__name__}: {e}")
    return out["sock"]


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, RuntimeError):
            pass


class ProxyRelay:
    """Relays connections accepted inside one sandbox to the proxy at (host, port)."""

    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.server: asyncio.AbstractServer | None = None
        self.port: int | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self, pid: int, port: int = SANDBOX_PROXY_PORT) -> int:
        sock = await asyncio.to_thread(bind_in_netns, pid, "127.0.0.1", port)
        self.port = sock.getsockname()[1]
        self.server = await asyncio.start_server(self._handle, sock=sock)
        return self.port

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns.add(task)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError as e:
                log.warning("sandbox relay: the proxy at %s:%d refused: %s", *self.target, e)
                return
            try:
                await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
            finally:
                up_writer.close()
        finally:
            writer.close()
            self._conns.discard(task)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            for t in list(self._conns):
                t.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
            self.server = None

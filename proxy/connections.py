"""connections.py: the proxy's connection layer, what one client can hold.

A connection is counted from its first byte and refused past a limit (below the fd limit)
with a 503 that reads nothing of it; its request headers have a deadline from its opening,
its body one from its headers; an encoded body is decoded here, bounded. A response being
streamed is never cut. The HTTP errors a request can earn (HttpError) are answered by
server.py in the shape of the API it called; here nothing knows the APIs. Not the handlers:
server.py owns the routes and the calls.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import resource
import time
import zlib
from collections.abc import Callable

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

log = logging.getLogger("gyre.proxy")

_REPORT_EVERY_S = 10.0


class HttpError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, *,
                 close: bool = False, overloaded: bool = False):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}
        self.close = close  # end the connection after the answer (the client is slow or broken)
        self.overloaded = overloaded  # a 503 the harness should retry (Anthropic: overloaded_error)


class Tally:
    """A recurring event logged once per interval with its count, never once per event."""

    def __init__(self, message: str):
        self.message, self.count, self._at = message, 0, None

    def note(self, *args: object) -> None:
        self.count += 1
        now = time.monotonic()
        if self._at is None or now - self._at >= _REPORT_EVERY_S:
            since = "" if self._at is None else f" ({self.count} in the last {now - self._at:.0f} s)"
            log.warning(self.message + since, *args)
            self._at, self.count = now, 0


class Connections:
    """The open connections of one proxy: their count, limit and header deadlines."""

    def __init__(self, max_connections: int, header_timeout_s: float):
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self._runner: web.BaseRunner | None = None
        self._header_timers: dict[web.RequestHandler, asyncio.TimerHandle] = {}
        self._refused = Tally("connections refused: %d open, the limit (max_connections)")
        self._slow_headers = Tally("connections closed without whole request headers after %.0f s "
                                   "(header_timeout_s)")

    async def serve(self, runner: web.BaseRunner, host: str, port: int) -> None:
        """Listen on host:port for `runner`'s application, every connection through here."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY and self.max_connections > soft - max(256, soft // 4):
            wanted, self.max_connections = self.max_connections, max(16, soft - max(256, soft // 4))
            # files, sockets, sandboxes need the rest
            log.info("max_connections %d clamped to %d: the fd limit is %d", wanted, self.max_connections, soft)
        self._runner = runner
        await _Site(runner, host, port, self._connection).start()

    def request_arrived(self, request: web.Request) -> None:
        """A request reached a handler: its connection's header deadline is met."""
        timer = self._header_timers.pop(request.protocol, None)
        if timer is not None:
            timer.cancel()

    def _connection(self) -> asyncio.BaseProtocol:
        """A new connection's protocol: aiohttp's, counted, with a deadline for its first
        request's headers; past the limit, one that answers 503 and closes (nothing else is
        read). Later requests on a kept-alive connection are bounded by aiohttp's keep-alive
        timer. Counted here, not from aiohttp's list: a burst of connections accepted in one
        loop turn are all created before any of them is registered there."""
        if self.open >= self.max_connections:
            self._refused.note(self.open)
            return _Refuse()
        self.open += 1
        proto = self._runner.server()
        if self.header_timeout_s > 0:
            loop = asyncio.get_running_loop()
            self._header_timers[proto] = loop.call_later(self.header_timeout_s, self._header_timeout, proto)
        return _Counted(proto, self._connection_lost)

    def _connection_lost(self, proto: web.RequestHandler) -> None:
        self.open -= 1
        timer = self._header_timers.pop(proto, None)
        if timer is not None:
            timer.cancel()

    def _header_timeout(self, proto: web.RequestHandler) -> None:
        self._header_timers.pop(proto, None)
        if proto.transport is not None:  # still open, and no request reached a handler
            self._slow_headers.note(self.header_timeout_s)
            proto.force_close()


# --- request bodies ---------------------------------------------------------------------

# Bodies arrive as sent (the runner's auto_decompress off): read_body decodes them, bounded, and
# an encoding it cannot decode is an HttpError (aiohttp's own answer is plain text). An aiohttp
# without the option decodes them itself, and read_body leaves them be.
OWN_DECODING = "auto_decompress" in inspect.signature(web.RequestHandler.__init__).parameters
RUNNER_OPTIONS = {"auto_decompress": False} if OWN_DECODING else {}
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """A request's body, decoded, at most `limit` bytes before and after decoding, within
    `timeout_s` of its headers (0: no deadline): 413, 408, 400 or 415 as HttpError."""
    codings = _codings(request.headers.get("Content-Encoding", "")) if OWN_DECODING else []  # before reading
    try:
        async with asyncio.timeout(timeout_s or None):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise HttpError(413, f"request body over the {limit}-byte limit", close=True) from None
    except TimeoutError:
        raise HttpError(408, f"request body not received within {timeout_s:g} s (body_timeout_s)",
                        close=True) from None
    except (RequestPayloadError, web.HTTPException) as e:  # e.g. a body cut short
        raise HttpError(400, f"request body could not be read: {e}", close=True) from None
    for coding in reversed(codings):
        raw = _inflate(raw, coding, limit)
    return raw


def _codings(header: str) -> list[str]:
    """A Content-Encoding header's codings in the order applied (identity dropped); 415 for
    one this proxy does not decode."""
    codings = [c.strip().lower() for c in header.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    unknown = [c for c in codings if c not in _WBITS]
    if unknown:
        raise HttpError(415, f"unsupported Content-Encoding {header!r}: this proxy decodes gzip and deflate "
                             "request bodies (or none)", close=True)
    return codings


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    """One coding undone, never past `limit` bytes (a small body may inflate to gigabytes):
    400 for data that is not that coding, 413 past the limit. gzip may hold several
    members; deflate is zlib-wrapped, or raw as some clients send it."""
    wbits, out, total = _WBITS[coding], [], 0
    while True:
        d = zlib.decompressobj(wbits)
        try:
            chunk = d.decompress(data, limit + 1 - total)
        except zlib.error as e:
            if coding == "deflate" and wbits > 0:
                wbits = -zlib.MAX_WBITS  # raw deflate: try once more
                continue
            raise HttpError(400, f"request body is not valid {coding} data ({e})", close=True) from None
        total += len(chunk)
        out.append(chunk)
        if total > limit or d.unconsumed_tail:
            raise HttpError(413, f"request body over the {limit}-byte limit once decoded ({coding})", close=True)
        if not d.eof:
            raise HttpError(400, f"request body's {coding} data is cut short", close=True)
        data = d.unused_data
        if not data:
            return b"".join(out)
        if coding == "deflate":
            raise HttpError(400, f"request body has {len(data)} bytes after its deflate data", close=True)


# --- the listening socket and a connection's protocol -----------------------------------


class _Site(web.BaseSite):
    """A TCP site whose connections come from `factory` (Connections._connection), so the
    proxy decides about each connection before aiohttp reads a byte of it."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, factory: Callable[[], asyncio.BaseProtocol]):
        super().__init__(runner, backlog=1024)
        self._host, self._port, self._factory = host, port, factory

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        self._server = await asyncio.get_running_loop().create_server(
            self._factory, self._host, self._port, backlog=self._backlog, reuse_address=True)


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, passed every call, telling Connections when
    the connection is gone (the count of open connections, its header deadline)."""

    __slots__ = ("_inner", "_lost")

    def __init__(self, inner: web.RequestHandler, lost: Callable[[web.RequestHandler], None]):
        self._inner, self._lost = inner, lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._inner.connection_lost(exc)
        finally:
            self._lost(self._inner)


_REFUSED = orjson.dumps({"type": "error", "error": {
    "type": "overloaded_error", "message": "too many open connections to the proxy (max_connections); retry"}})


class _Refuse(asyncio.Protocol):
    """A connection past the limit: a 503 (retryable, both SDKs parse the body) and close;
    nothing of the request is read, so it costs an fd for a moment only."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                        b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                        % (len(_REFUSED), _REFUSED))
        transport.close()

"""support.py: in-process stand-ins around a real proxy, for tests (and bench/proxy.py).

`ThreadEngineBackend` drives one engine (the scripted one, or the real CPU engine: anything
with `add_request`/`step`/`abort`) on a thread behind the proxy's `Backend` interface, where
a run routes over ZeroMQ (coordinator/routing.py). `FaultyProxyServer` is the real
`ProxyServer` that answers chosen model calls with an error, or cuts their stream. Lives under
tests/, never in the product path.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
from aiohttp import web

from gyre.proxy import api_anthropic
from gyre.proxy.backend import Chunk, EngineRefused, GenParams
from gyre.proxy.server import HttpError, ProxyServer
from gyre.proxy.types import ChatRequest


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class ThreadEngineBackend:
    """Drives one engine on a dedicated thread; results cross back with call_soon_threadsafe."""

    def __init__(self, engine: Any, *, name: str = "local", sampling_cls: Any = None):
        self.engine = engine
        self.name = name
        self._sampling_cls = sampling_cls
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"gyre-engine-{name}", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    async def generate(self, rid: str, prompt_ids, params: GenParams,
                       execution: str | None = None) -> AsyncIterator[Chunk]:
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            self._streams[rid] = stream
        self._inbox.put(("add", rid, prompt_ids, params))
        try:
            while True:
                q = stream.queue
                item = q.get_nowait() if not q.empty() else await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)

    async def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def forget(self, execution: str) -> None:
        """One engine: no homes to forget."""

    # --- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            block = self.engine.running == 0
            try:
                cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._command(cmd)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.engine.running:
                for out in self.engine.step():
                    cached = getattr(out, "cached_tokens", None)  # stand-in engines do not say
                    self._deliver(out.rid, Chunk(token_ids=out.token_ids, logprobs=out.logprobs, version=out.version,
                                                 finished=out.finished, finish_reason=out.finish_reason,
                                                 engine=self.name, cached_tokens=cached,
                                                 prefill_tokens=None if cached is None else out.prompt_tokens - cached))

    def _command(self, cmd) -> None:
        if cmd[0] == "add":
            _, rid, prompt_ids, p = cmd
            try:
                params = self._sampling_cls(max_new_tokens=p.max_new_tokens, temperature=p.temperature,
                                            top_p=p.top_p, stop_token_ids=p.stop_token_ids, seed=p.seed)
                self.engine.add_request(rid, np.asarray(prompt_ids).tolist(), params)  # the engine's thread
            except ValueError as e:  # the request's fault
                self._deliver(rid, EngineRefused(str(e)))
            except Exception as e:  # noqa: BLE001 - handed to the waiting request
                self._deliver(rid, e)
        elif cmd[0] == "abort":
            out = self.engine.abort(cmd[1])
            if out is not None:
                self._deliver(cmd[1], Chunk(token_ids=[], logprobs=[], version=out.version, finished=True,
                                            finish_reason="abort", engine=self.name))

    def _deliver(self, rid: str, item) -> None:
        with self._lock:
            stream = self._streams.get(rid)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


CUT_STREAM = 0  # an injected "status": open the stream, then drop the connection before any content


class FaultyProxyServer(ProxyServer):
    """A ProxyServer whose next model calls are answered from `inject_errors`, in order:
    (status, headers) pairs, answered as that error in the API's shape (status CUT_STREAM:
    the stream's opening events, then the connection dropped). Empty, it is the plain server."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.inject_errors: list[tuple[int, dict[str, str]]] = []

    async def _intercept(self, request: web.Request, api: ModuleType, req: ChatRequest) -> web.StreamResponse | None:
        if not self.inject_errors:
            return None
        status, headers = self.inject_errors.pop(0)
        if status == CUT_STREAM:
            return await _cut_stream(request, api, req)
        raise HttpError(status, "injected error (test)", headers)


async def _cut_stream(request: web.Request, api: ModuleType, req: ChatRequest) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    kwargs = {"input_tokens": 0} if api is api_anthropic else {}
    for event in api.Stream(req, api.new_response_id(), **kwargs).start():
        await resp.write(event)
    request.transport.close()
    return resp

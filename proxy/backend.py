"""backend.py: where the proxy's generations run, behind one small async interface.

`Backend.generate` streams chunks (token ids, log-probs, policy version) for one request
and `abort` stops it. The coordinator implements it over its ZeroMQ routing table;
`ThreadEngineBackend` runs an in-process engine (anything with `add_request`/`step`/
`abort`, e.g. the CPU engine) on its own thread, for `gyre serve` and tests. Not a
router: choosing an engine is the coordinator's job.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol


@dataclass(frozen=True, slots=True, kw_only=True)
class GenParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass(slots=True, kw_only=True)
class Chunk:
    token_ids: list[int]
    logprobs: list[float]
    version: int
    finished: bool = False
    finish_reason: str | None = None
    engine: str = ""


class BackendUnavailable(RuntimeError):
    """No engine can take the request now (all dead or draining); answered with 503."""


class EngineRefused(ValueError):
    """The engine refused the request itself (a prompt past its context, ids outside its
    vocabulary): the request's fault, answered 400 like any bad request, never a 5xx."""


class Backend(Protocol):
    def generate(self, rid: str, prompt_ids: list[int], params: GenParams) -> AsyncIterator[Chunk]: ...

    async def abort(self, rid: str) -> None: ...


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

    async def generate(self, rid: str, prompt_ids: list[int], params: GenParams) -> AsyncIterator[Chunk]:
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
                    self._deliver(out.rid, Chunk(token_ids=out.token_ids, logprobs=out.logprobs, version=out.version,
                                                 finished=out.finished, finish_reason=out.finish_reason,
                                                 engine=self.name))

    def _command(self, cmd) -> None:
        if cmd[0] == "add":
            _, rid, prompt_ids, p = cmd
            try:
                params = self._sampling_cls(max_new_tokens=p.max_new_tokens, temperature=p.temperature,
                                            top_p=p.top_p, stop_token_ids=p.stop_token_ids, seed=p.seed)
                self.engine.add_request(rid, prompt_ids, params)
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

"""server.py: the HTTP proxy (aiohttp) that every harness talks to.

One handler path for the three provider APIs: authenticate the per-execution key, parse
into a ChatRequest, let the execution build the exact prompt ids, stream the engine's
tokens back through the output parser (SSE token by token, keep-alives while waiting),
and record the call. Bad input is a provider-shaped 4xx that touches no record. Runs in
the caller's event loop (the coordinator's, or `gyre serve`'s). Not the engine router:
a `Backend` is handed in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
from aiohttp import web

from gyre.proxy import api_anthropic, api_openai, api_responses
from gyre.proxy.backend import Backend, BackendUnavailable, EngineRefused, GenParams
from gyre.proxy.chat import ChatTokenizer
from gyre.proxy.parser import OutputParser
from gyre.proxy.recorder import Prepared, Recorder, new_key
from gyre.proxy.roles import rule
from gyre.proxy.types import ChatRequest, ChatResult, ContextOverflow, RequestError, Usage

log = logging.getLogger("gyre.proxy")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 0
    max_body_bytes: int = 32 * 1024 * 1024
    default_max_tokens: int | None = None  # when a request sets no output limit; None: the remaining context
    max_tokens_cap: int | None = None  # a request asking more gets this; None: the remaining context
    max_context: int = 32768  # prompt + output tokens (callers pass the model's max_position_embeddings)
    temperature: float = 1.0  # every call samples at this (the run's rollout_temperature) ...
    top_p: float = 1.0  # ... and this; a harness's own values are recorded, not used
    ping_interval_s: float = 5.0
    role_rule: str = "generic"
    served_model: str = "gyre-policy"
    record_requests: bool = False  # also keep each raw request body (keys stripped) in requests.jsonl


class HttpError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


class ProxyServer:
    def __init__(self, tokenizer: ChatTokenizer, backend: Backend, config: ProxyConfig | None = None,
                 run_dir: Path | None = None):
        self.tokenizer = tokenizer
        self.backend = backend
        self.config = config or ProxyConfig()
        self.run_dir = run_dir
        self.executions: dict[str, Recorder] = {}
        self._by_key: dict[str, Recorder] = {}
        self._runner: web.AppRunner | None = None
        self.base_url = ""
        self.on_record: Callable[[Recorder, dict], None] | None = None  # called as each call is recorded
        self.status_provider: Callable[[], dict] | None = None  # the coordinator's live state

    # --- executions ---------------------------------------------------------------------

    def register(self, exec_id: str, role_rule: str | None = None) -> Recorder:
        """A new execution with a fresh random key; its calls are recorded under run_dir and
        classified by `role_rule` (default: the config's)."""
        if exec_id in self.executions:
            raise ValueError(f"execution {exec_id!r} already registered")
        folder = self.run_dir / "executions" / exec_id if self.run_dir else None
        ex = Recorder(exec_id, new_key(), self.tokenizer, rule(role_rule or self.config.role_rule), dir=folder)
        self.executions[exec_id] = ex
        self._by_key[ex.key] = ex
        return ex

    def revoke(self, exec_id: str) -> Recorder:
        """The execution ended: its key stops working; its records stay."""
        ex = self.executions[exec_id]
        self._by_key.pop(ex.key, None)
        self.backend.forget(exec_id)
        if not ex.closed:
            ex.close()
        return ex

    # --- lifecycle ----------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        for path, api in (("/v1/chat/completions", api_openai), ("/v1/messages", api_anthropic),
                          ("/v1/responses", api_responses)):
            app.router.add_post(path, self._handler_for(api))
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/gyre/status", self._status)
        app.router.add_get("/", self._health)
        return app

    def _handler_for(self, api: ModuleType):
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self._handle(request, api)

        return handler

    async def start(self) -> str:
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}"
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        for ex in self.executions.values():
            if not ex.closed:
                ex.close()

    # --- plain endpoints ----------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "executions": len(self._by_key)})

    async def _status(self, request: web.Request) -> web.Response:
        """The coordinator's state for `gyre top` (no keys, no prompts in it)."""
        if self.status_provider is None:
            return web.json_response({"error": "no coordinator behind this proxy"}, status=404)
        return web.json_response(self.status_provider(), dumps=_dumps)

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._auth(request, api_openai)
        except HttpError as e:
            return _error(api_openai, e.status, e.message, e.headers)
        now = int(time.time())
        return web.json_response({"object": "list", "data": [
            {"id": self.config.served_model, "object": "model", "created": now, "owned_by": "gyre",
             "type": "model", "display_name": self.config.served_model, "created_at": "1970-01-01T00:00:00Z"}]})

    async def _count_tokens(self, request: web.Request) -> web.Response:
        try:
            self._auth(request, api_anthropic)
            body = await self._json(request)
            req = api_anthropic.parse_count_tokens(body, dict(request.headers))
            return web.json_response({"input_tokens": len(self.tokenizer.prompt_ids(req.messages, req.tools))})
        except HttpError as e:
            return _error(api_anthropic, e.status, e.message, e.headers)
        except RequestError as e:
            return _error(api_anthropic, e.status, str(e))

    # --- model calls --------------------------------------------------------------------

    def _auth(self, request: web.Request, api: ModuleType) -> Recorder:
        key = request.headers.get("x-api-key")
        auth = request.headers.get("Authorization", "")
        if not key and auth.lower().startswith("bearer "):
            key = auth[7:].strip()
        ex = self._by_key.get(key or "")
        if ex is None:
            raise HttpError(401, "invalid API key: this proxy accepts only per-execution keys")
        return ex

    async def _json(self, request: web.Request) -> Any:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise HttpError(413, f"request body over the {self.config.max_body_bytes}-byte limit") from None
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise HttpError(400, f"malformed JSON body: {e}") from None

    async def _handle(self, request: web.Request, api: ModuleType) -> web.StreamResponse:
        try:
            execution = self._auth(request, api)
            body = await self._json(request)
            req = api.parse_request(body, dict(request.headers), memo=execution.parse_memo)
            instead = await self._intercept(request, api, req)
            if instead is not None:
                return instead
            if self.config.record_requests:
                execution.record_request(body, dict(request.headers), str(request.rel_url))
            prep = execution.prepare(req, dict(request.headers), max_context=self.config.max_context)
        except HttpError as e:
            return _error(api, e.status, e.message, e.headers)
        except ContextOverflow as e:  # in the provider's own words: harnesses compact on them
            return _json_error(400, api.overflow_body(e.prompt_tokens, e.max_context))
        except RequestError as e:
            return _error(api, e.status, str(e))
        except ValueError as e:
            return _error(api, 400, str(e))
        budget = self.config.max_context - len(prep.prompt_ids)
        call = _Call(self, request, api, req, execution, prep, self._max_tokens(req, budget))
        return await call.run()

    async def _intercept(self, request: web.Request, api: ModuleType, req: ChatRequest) -> web.StreamResponse | None:
        """The reply that stands in for this model call, or None (here: always None). A seam
        for tests, which answer chosen calls with errors (tests/support.py); an HttpError
        raised here is answered in the API's shape."""
        return None

    def _max_tokens(self, req: ChatRequest, budget: int) -> int:
        """The request's limit (else the default), cut to the cap and to the context left."""
        c = self.config
        asked = req.max_tokens or c.default_max_tokens or budget
        return max(1, min(asked, c.max_tokens_cap or budget, budget))


class _Call:
    """One model call in flight: generation, parsing, streaming, recording."""

    def __init__(self, server: ProxyServer, request: web.Request, api: ModuleType, req: ChatRequest,
                 execution: Recorder, prep: Prepared, max_new: int):
        self.s, self.request, self.api, self.req, self.ex, self.prep = server, request, api, req, execution, prep
        tok = server.tokenizer
        # The run's sampling, whatever the harness asked (its values go into the record).
        self.params = GenParams(max_new_tokens=max_new, temperature=server.config.temperature,
                                top_p=server.config.top_p, stop_token_ids=tuple(sorted(tok.stop_token_ids)))
        self.parser = OutputParser(tok.decode, stop_token_ids=tok.stop_token_ids, tool_open=tok.tool_call_open,
                                   tool_close=tok.tool_call_close, new_call_id=api.new_tool_call_id,
                                   stop_strings=req.stop)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.engine = ""
        self.cached_tokens: int | None = None  # the backend's count; None: it did not say
        self.prefill_tokens: int | None = None
        self.finish = "stop"
        self.response_id = api.new_response_id()
        self.recorded = False

    async def run(self) -> web.StreamResponse:
        """The except ladder: each outcome is recorded once, with its status."""
        queue: asyncio.Queue = asyncio.Queue()
        pump = asyncio.create_task(self._pump(queue), name=f"gyre-gen-{self.prep.call_id}")
        try:
            if self.req.stream:
                return await self._stream(queue)
            return await self._whole(queue)
        except asyncio.CancelledError:
            # The client went away: stop generating, keep what was produced, marked.
            self._record("disconnected")
            raise
        except (ConnectionResetError, BrokenPipeError):
            self._record("disconnected")
            return web.Response(status=499)
        except (BackendUnavailable, EngineRefused) as e:
            # No engine at all (503, retryable) or the engine refused the request (400): the
            # call is kept as an error record.
            self._record("error")
            return _error(self.api, *_status_of(e))
        except Exception as e:  # noqa: BLE001 - recorded and answered, never a silent drop
            log.exception("call %s failed", self.prep.call_id)
            self._record("error")
            return _error(self.api, 500, f"internal error: {type(e).__name__}: {e}")
        finally:
            if not pump.done():
                pump.cancel()
                await self.s.backend.abort(self.prep.call_id)

    async def _pump(self, queue: asyncio.Queue) -> None:
        try:
            async for chunk in self.s.backend.generate(self.prep.call_id, self.prep.prompt_ids, self.params,
                                                        execution=self.ex.id):
                queue.put_nowait(chunk)
        except Exception as e:  # noqa: BLE001 - handed to the handler
            queue.put_nowait(e)

    async def _next(self, queue: asyncio.Queue, ping=None):
        """Next chunk; while waiting, `ping()` every ping interval (keeps SSE alive)."""
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), self.s.config.ping_interval_s)
            except TimeoutError:
                if ping is not None:
                    await ping()
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def _absorb(self, chunk) -> list:
        self.ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.versions += [chunk.version] * len(chunk.token_ids)
        self.engine = chunk.engine or self.engine
        self.cached_tokens, self.prefill_tokens = chunk.cached_tokens, chunk.prefill_tokens
        deltas = self.parser.feed(chunk.token_ids)
        if chunk.finished:
            deltas += self.parser.finish()
            self.finish = "length" if chunk.finish_reason == "length" else "stop"
        return deltas

    @property
    def kept(self) -> int:
        """Output tokens that count: all, or those before a stop string's token (parser.py)."""
        return len(self.ids) if self.parser.kept is None else self.parser.kept

    def _result(self) -> ChatResult:
        reason = "tool_calls" if self.parser.tool_calls else self.finish
        return ChatResult(id=self.response_id, model=self.req.model, content=self.parser.content,
                          tool_calls=list(self.parser.tool_calls), finish_reason=reason,
                          usage=Usage(len(self.prep.prompt_ids), self.kept))

    async def _stop_early(self) -> bool:
        """A stop string matched: abort generation; the output ends here."""
        if self.parser.stopped:
            await self.s.backend.abort(self.prep.call_id)
            self.parser.finish()
            self.finish = "stop"
            return True
        return False

    async def _whole(self, queue: asyncio.Queue) -> web.Response:
        while True:
            chunk = await self._next(queue)
            self._absorb(chunk)
            if await self._stop_early() or chunk.finished:  # a stop string decides first
                break
        result = self._result()
        self._record("ok", result)
        return web.json_response(self.api.render_result(result, self.req), dumps=_dumps)

    async def _stream(self, queue: asyncio.Queue) -> web.StreamResponse:
        # Headers and the opening events go out at once: a harness waiting for its first byte
        # must not time out while the engine queues or prefills (or a cell changes role).
        # Everything decidable before generation was answered with a plain status already;
        # a failure from here on is an error event in the API's own shape, and waits are
        # filled with keep-alives the harness honours.
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(self.request)
        kwargs = {"input_tokens": len(self.prep.prompt_ids)} if self.api is api_anthropic else {}
        stream = self.api.Stream(self.req, self.response_id, **kwargs)
        for event in stream.start():
            await resp.write(event)
        try:
            while True:
                chunk = await self._next(queue, ping=lambda: resp.write(stream.ping()))
                for d in self._absorb(chunk):
                    for event in stream.delta(d):
                        await resp.write(event)
                if await self._stop_early() or chunk.finished:  # a stop string decides first
                    break
        except (asyncio.CancelledError, ConnectionResetError, BrokenPipeError):
            raise  # the client left: run() records it
        except Exception as e:  # noqa: BLE001 - the stream has started: answered in it, recorded
            if not isinstance(e, (BackendUnavailable, EngineRefused)):
                log.exception("call %s failed mid-stream", self.prep.call_id)
            self._record("error")
            status, message = _status_of(e)
            for event in stream.error(status, message):
                await resp.write(event)
            await resp.write_eof()
            return resp
        result = self._result()
        self._record("ok", result)
        for event in stream.finish(result):
            await resp.write(event)
        await resp.write_eof()
        return resp

    def _record(self, status: str, result: ChatResult | None = None) -> None:
        if self.recorded:
            return
        self.recorded = True
        n = self.kept  # the recorded output is what the client was given
        # The record's finish reason is what ended the call: an error or a disconnect, tool
        # calls, else the engine's stop or length.
        finish = status if status != "ok" else "tool_calls" if self.parser.tool_calls else self.finish
        record = self.ex.complete(self.prep, output_ids=self.ids[:n], logprobs=self.logprobs[:n],
                                  versions=self.versions[:n], finish_reason=finish, status=status,
                                  engine=self.engine, result=result, request=self.req,
                                  invalid_tool_calls=self.parser.invalid_tool_calls,
                                  cached_tokens=self.cached_tokens, prefill_tokens=self.prefill_tokens,
                                  sampling={"temperature": self.params.temperature, "top_p": self.params.top_p,
                                            "client_temperature": self.req.temperature,
                                            "client_top_p": self.req.top_p})
        if self.s.on_record is not None:
            self.s.on_record(self.ex, record)


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def _error(api: ModuleType, status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return _json_error(status, api.error_body(status, message), headers)


def _json_error(status: int, body: dict, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json", headers=headers)


def _status_of(e: Exception) -> tuple[int, str]:
    """The status and message a failure during generation is answered with."""
    if isinstance(e, BackendUnavailable):
        return 503, f"no rollout engine available: {e}"
    if isinstance(e, EngineRefused):
        return 400, f"the engine refused the request: {e}"
    return 500, f"internal error: {type(e).__name__}: {e}"

"""server.py: the HTTP proxy (aiohttp) that every harness talks to.

One handler path for the three provider APIs: authenticate the per-execution key, wait
for the execution's budget (calls in flight, tokens per minute: budget.py; a 429 past it),
parse into a ChatRequest, let the execution build the exact prompt ids, stream the
engine's tokens back through the output parser (SSE token by token, keep-alives while
waiting), and record the call. Parsing, rendering and tokenizing run on prompt threads,
never on the event loop, and a body longer than any prompt that fits the context is
refused before them (the provider's overflow answer). Bad input is a provider-shaped 4xx
that touches no record; a disk that refuses a record is a provider-shaped 503 with
`retry-after` and leaves none; each answer that was gyre's own refusal is counted on the
execution's Recorder (`refusals`, `refused_last`). What a client can hold (deadlines for
headers and bodies, a connection limit, encoded bodies) is connections.py's; one call in
flight, streamed as long as it takes, is call.py's. Runs in the caller's event loop (the
coordinator's, or `gyre serve`'s). Not the engine router: a `Backend` is handed in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
from aiohttp import web

from gyre.proxy import api_anthropic, api_openai, api_responses
from gyre.proxy.backend import Backend
from gyre.proxy.binding import Bindings
from gyre.proxy.budget import Budgets, OverBudget
from gyre.proxy.call import ProxiedCall, api_error, dumps_str, http_error, is_refusal, json_error
from gyre.proxy.chat import ChatTokenizer
from gyre.proxy.connections import RUNNER_OPTIONS, Connections, HttpError, Tally, read_body
from gyre.proxy.recorder import Recorder, new_key
from gyre.proxy.records import JournalError
from gyre.proxy.roles import rule
from gyre.proxy.serving import ProxyConfig
from gyre.proxy.types import ChatRequest, ContextOverflow, RequestError

log = logging.getLogger("gyre.proxy")


DISK_RETRY_AFTER_S = 10  # a full disk: harnesses retry after this
# A body is refused unread by the tokenizer when longer than FIT_FACTOR x max_context x the
# most JSON bytes one token can take, plus FIT_SLACK_BYTES: it cannot fit the context. The
# factor and the slack cover what the bound does not see (JSON's own syntax and spacing,
# fields no template renders, normalisers that join characters).
FIT_FACTOR = 2
FIT_SLACK_BYTES = 1 << 20
PROMPT_THREADS = 4  # threads that parse, render and tokenize requests
_MAX_DEPTH = 254 - 8  # JSON nesting a request may have (orjson's writing limit less the margin _loads checks)


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
        self.connections = Connections(self.config.max_connections, self.config.header_timeout_s)
        self._disk = Tally("model calls answered 503, records cannot be written: %s")
        self._parser_gaps = Tally("request parser gap, answered 400: %s at %s")
        self._over_budget = Tally("model calls answered 429, over their execution's budget: %s (execution %s)")
        c = self.config
        self.bindings = Bindings()  # keys that work only from their harness's sessions (the process backend)
        self.budgets = Budgets(c.max_calls_in_flight_per_execution, c.max_tokens_per_minute_per_execution,
                               c.budget_wait_s)
        # Parsing, rendering and tokenizing run on these threads, never on the event loop (one
        # 30 MiB prompt there stalled every execution for minutes), and on several, so a long
        # prompt delays no other execution's. Each execution's parse memo, segmenter and tree
        # have one user at a time (its lock); the tokenizer's memos lock themselves.
        self._prompts = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="gyre-prompts")
        self._prompt_locks: dict[str, asyncio.Lock] = {}  # execution -> its parse, plan and apply, one at a time
        per_token = getattr(tokenizer, "max_json_bytes_per_token", None)
        # The longest body that might fit max_context (0: no such bound); max_body_bytes stays the outer one.
        self.fit_bytes = FIT_FACTOR * c.max_context * per_token + FIT_SLACK_BYTES if per_token else 0

    # --- executions ---------------------------------------------------------------------

    def register(self, exec_id: str, role_rule: str | None = None, *, resume_key: str | None = None) -> Recorder:
        """A new execution with a fresh random key; its calls are recorded under run_dir and
        classified by `role_rule` (default: the config's). With `resume_key`, an execution
        that outlived an earlier coordinator: its key again (the harness still holds it) and
        its Recorder rebuilt from its folder (Recorder.resumed: later calls extend its tree)."""
        if exec_id in self.executions:
            raise ValueError(f"execution {exec_id!r} already registered")
        folder = self.run_dir / "executions" / exec_id if self.run_dir else None
        classify = rule(role_rule or self.config.role_rule)
        if resume_key is not None:
            if folder is None:
                raise ValueError(f"execution {exec_id!r}: nothing to resume without a run directory")
            ex = Recorder.resumed(exec_id, resume_key, self.tokenizer, classify, folder)
        else:
            ex = Recorder(exec_id, new_key(), self.tokenizer, classify, dir=folder)
        self.executions[exec_id] = ex
        self._by_key[ex.key] = ex
        return ex

    def revoke(self, exec_id: str) -> Recorder:
        """The execution ended: its key stops working; its records stay."""
        ex = self.executions[exec_id]
        self._by_key.pop(ex.key, None)
        self.backend.forget(exec_id)
        self.budgets.forget(exec_id)
        self.bindings.forget(exec_id)
        self._prompt_locks.pop(exec_id, None)
        if not ex.closed:
            ex.close()
        return ex

    def release(self, exec_id: str) -> None:
        """A revoked execution's tree and call records out of memory (its files stay): the
        coordinator calls it once the execution is trained, or can never be, and on disk."""
        ex = self.executions.get(exec_id)
        if ex is None:  # restored from its files by a resume, never registered here
            return
        if not ex.closed:
            raise ValueError(f"execution {exec_id!r} is still open: revoke it first")
        del self.executions[exec_id]

    def sync(self) -> None:
        """fsync every execution's records so far (closed ones too, once); the coordinator
        calls it at checkpoints. Raises JournalError when the disk refuses."""
        for ex in self.executions.values():
            ex.sync()

    # --- lifecycle ----------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._headers_arrived])
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
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None,
                                     keepalive_timeout=self.config.keepalive_timeout_s, **RUNNER_OPTIONS)
        await self._runner.setup()
        await self.connections.serve(self._runner, self.config.host, self.config.port)
        host, port = self._runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}"
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        self._prompts.shutdown(wait=False, cancel_futures=True)
        for ex in self.executions.values():
            if not ex.closed:
                ex.close()

    @web.middleware
    async def _headers_arrived(self, request: web.Request, handler):
        """A request reached a handler: its connection's header deadline is met. aiohttp's
        own 4xx (an unknown path, a wrong method) are answered as JSON errors too, in the
        shape of the API the path belongs to."""
        self.connections.request_arrived(request)
        try:
            return await handler(request)
        except web.HTTPException as e:
            if not 400 <= e.status < 500:
                raise
            api = api_anthropic if request.path.startswith("/v1/messages") else api_openai
            return api_error(api, e.status, f"{request.method} {request.path}: {e.reason}",
                          {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None)

    # --- plain endpoints ----------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "executions": len(self._by_key)})

    async def _status(self, request: web.Request) -> web.Response:
        """The coordinator's state for `gyre top` (no keys, no prompts in it)."""
        if self.status_provider is None:
            return web.json_response({"error": "no coordinator behind this proxy"}, status=404)
        return web.json_response(self.status_provider(), dumps=dumps_str)

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._auth(request, api_openai)
        except HttpError as e:
            return http_error(api_openai, e)
        now = int(time.time())
        return web.json_response({"object": "list", "data": [
            {"id": self.config.served_model, "object": "model", "created": now, "owned_by": "gyre",
             "type": "model", "display_name": self.config.served_model, "created_at": "1970-01-01T00:00:00Z"}]})

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """Counted on the prompt threads, within the execution's budget (tokenizing is work)."""
        try:
            execution = await self._authed(request, api_anthropic)
            await self.budgets.admit(execution.id)
        except HttpError as e:
            return http_error(api_anthropic, e)
        except OverBudget as e:
            return self._over_budget_answer(api_anthropic, execution, e)
        try:
            return await self._count(request)
        finally:
            self.budgets.release(execution.id)

    async def _count(self, request: web.Request) -> web.Response:
        try:
            raw = await self._read(request)
            headers = dict(request.headers)

            def count() -> int:
                req = self._parse(lambda: api_anthropic.parse_count_tokens(self._loads(raw), headers))
                return len(self.tokenizer.prompt_ids(req.messages, req.tools, max_context=self.config.max_context))

            return web.json_response({"input_tokens": await self._off_loop(count)})
        except HttpError as e:
            return http_error(api_anthropic, e)
        except ContextOverflow as e:
            return json_error(400, api_anthropic.overflow_body(e.prompt_tokens, e.max_context))
        except RequestError as e:
            return api_error(api_anthropic, e.status, str(e))
        except ValueError as e:
            return api_error(api_anthropic, 400, str(e))

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

    async def _authed(self, request: web.Request, api: ModuleType) -> Recorder:
        """`_auth`, and where the key is bound to its harness's sessions (bindings.py), the
        connecting process one of them."""
        ex = self._auth(request, api)
        if self.bindings.bound(ex.id):
            why = await self.bindings.refusal(ex.id, request.transport)
            if why is not None:
                raise HttpError(401, f"invalid API key here: {why}")
        return ex

    async def _off_loop(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on the prompt thread: the event loop serves everyone else meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._prompts, fn)

    async def _read(self, request: web.Request) -> bytes:
        """The body, refused (a context overflow, in the provider's words) before anything
        parses or tokenizes it when it is longer than any prompt that fits the context."""
        raw = await read_body(request, self.config.max_body_bytes, self.config.body_timeout_s)
        if self.fit_bytes and len(raw) > self.fit_bytes:
            raise ContextOverflow(self._tokens_at_least(len(raw)), self.config.max_context)
        return raw

    def _tokens_at_least(self, n_bytes: int) -> int:
        """Prompt tokens a body of `n_bytes` has at least (by the fit bound; past the context)."""
        per = (self.fit_bytes - FIT_SLACK_BYTES) // self.config.max_context
        return max(self.config.max_context, (n_bytes - FIT_SLACK_BYTES) // per)

    def _loads(self, raw: bytes) -> Any:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise HttpError(400, f"malformed JSON body: {e}") from None
        try:
            # orjson reads JSON nested 1024 deep but writes only 254; the proxy writes parts
            # of a request back (tool arguments, echoed fields, records) a few levels deeper
            # still. One write of the body, margin included, refuses what would fail later
            # (a third of the read's cost).
            orjson.dumps([[[[[[[[body]]]]]]]])
        except TypeError:
            raise HttpError(400, f"request body nested deeper than {_MAX_DEPTH} levels") from None
        return body

    def _parse(self, parse: Callable[[], ChatRequest]) -> ChatRequest:
        """An API's parser run: RequestError (a ValueError) as it says; an exception it did
        not foresee is still the request's fault (a parser only reads the body), so a 400
        that names it, and a warning naming the parser's gap."""
        try:
            return parse()
        except (TypeError, AttributeError, KeyError, IndexError, RecursionError) as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            self._parser_gaps.note(f"{type(e).__name__}: {e}", f"{Path(where.filename).name}:{where.lineno}")
            raise HttpError(400, f"malformed request: {type(e).__name__}: {e}") from None

    def _check_disk(self, execution: Recorder) -> None:
        """A disk nearly full where the execution records: 503 before anything is generated."""
        need = self.config.min_free_disk_bytes
        if not need or execution.dir is None:
            return
        try:
            st = os.statvfs(execution.dir)
        except OSError:
            return  # the write itself will say
        free = st.f_bavail * st.f_frsize
        if free < need:
            message = f"{free} bytes free under {execution.dir}, below min_free_disk_bytes ({need})"
            self._disk.note(message)
            raise HttpError(503, f"the proxy cannot record calls now: {message}",
                            {"retry-after": str(DISK_RETRY_AFTER_S)}, overloaded=True)

    async def _handle(self, request: web.Request, api: ModuleType) -> web.StreamResponse:
        """Authenticate, wait for the execution's budget (429 past it), serve the call."""
        try:
            execution = await self._authed(request, api)
            await self.budgets.admit(execution.id)
        except HttpError as e:
            return http_error(api, e)
        except OverBudget as e:
            return self._over_budget_answer(api, execution, e)
        try:
            return await self._admitted(request, api, execution)
        finally:
            self.budgets.release(execution.id)

    def _over_budget_answer(self, api: ModuleType, execution: Recorder, e: OverBudget) -> web.Response:
        """A 429 in the API's shape, with when to retry; gyre's own refusal, counted."""
        self._over_budget.note(e.message, execution.id)
        execution.note_answer(refused=True, why=f"429 {e.message}")
        wait = str(e.retry_after_s)
        return json_error(429, api.rate_limit_body(e.message, e.kind),
                           {"retry-after": wait, "retry-after-ms": f"{wait}000", "x-should-retry": "true"})

    async def _admitted(self, request: web.Request, api: ModuleType, execution: Recorder) -> web.StreamResponse:
        headers = dict(request.headers)
        try:
            raw = await self._read(request)
            async with self._lock_of(execution):  # its parse memo, segmenter and tree: one call at a time
                body, req = await self._off_loop(lambda: self._request(api, raw, headers, execution))
                instead = await self._intercept(request, api, req)
                if instead is not None:
                    execution.note_answer(refused=is_refusal(instead.status), why=f"{instead.status}")
                    return instead
                self._check_disk(execution)
                if self.config.record_requests:
                    execution.record_request(body, headers, str(request.rel_url))
                planned = await self._off_loop(lambda: execution.plan(req, max_context=self.config.max_context))
                prep = execution.apply(planned, headers)
        except HttpError as e:
            execution.note_answer(refused=is_refusal(e.status), why=f"{e.status} {e}")
            return http_error(api, e)
        except JournalError as e:  # the prompt's nodes could not be written: taken back, nothing recorded
            execution.note_answer(refused=True, why=f"503 the disk is full: {e}")
            return self._disk_full(api, e)
        except ContextOverflow as e:  # in the provider's own words: harnesses compact on them
            execution.note_answer(refused=False)
            return json_error(400, api.overflow_body(e.prompt_tokens, e.max_context))
        except RequestError as e:
            execution.note_answer(refused=False)
            return api_error(api, e.status, str(e))
        except ValueError as e:
            execution.note_answer(refused=False)
            return api_error(api, 400, str(e))
        self.budgets.charge(execution.id, prep.new_tokens)
        budget = self.config.max_context - len(prep.prompt_ids)
        call = ProxiedCall(self, request, api, req, execution, prep, self._max_tokens(req, budget))
        return await call.run()

    def _lock_of(self, execution: Recorder) -> asyncio.Lock:
        lock = self._prompt_locks.get(execution.id)
        if lock is None:
            lock = self._prompt_locks[execution.id] = asyncio.Lock()
        return lock

    def _request(self, api: ModuleType, raw: bytes, headers: dict[str, str], execution: Recorder):
        """The body and the request it parses to (on the prompt thread)."""
        body = self._loads(raw)
        return body, self._parse(lambda: api.parse_request(body, headers, memo=execution.parse_memo))

    async def _intercept(self, request: web.Request, api: ModuleType, req: ChatRequest) -> web.StreamResponse | None:
        """The reply that stands in for this model call, or None (here: always None). A seam
        for tests, which answer chosen calls with errors (tests/support.py); an HttpError
        raised here is answered in the API's shape."""
        return None

    def _disk_full(self, api: ModuleType, e: JournalError) -> web.Response:
        self._disk.note(e)
        return http_error(api, HttpError(503, f"the proxy cannot record calls now: {e}",
                                          {"retry-after": str(DISK_RETRY_AFTER_S)}, overloaded=True))

    def _max_tokens(self, req: ChatRequest, budget: int) -> int:
        """The request's limit (else the default), cut to the cap and to the context left."""
        c = self.config
        asked = req.max_tokens or c.default_max_tokens or budget
        return max(1, min(asked, c.max_tokens_cap or budget, budget))

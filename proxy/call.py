"""call.py: one admitted model call in flight, and the provider-shaped answers.

`ProxiedCall` runs a call the server has authenticated, budgeted and prepared (server.py):
generation through the backend, the output parser, the answer whole or streamed (SSE token
by token, keep-alives while the engine is silent), and the call's record, written once
with the status that ended it (ok, error, disconnected). Its except ladder answers a full
disk 503 (nothing recorded), no engine 503, an engine refusal 400, anything else 500, and
counts each of gyre's own refusals on the execution's Recorder. The helpers below shape an
error in the path's API. Not the routes, nor what a client can hold (server.py,
connections.py).
"""

from __future__ import annotations

import asyncio
import logging
from types import ModuleType
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from gyre.proxy import api_anthropic
from gyre.proxy.backend import BackendUnavailable, EngineRefused, GenParams
from gyre.proxy.connections import HttpError
from gyre.proxy.recorder import Prepared, Recorder, output_parser, parsed_result
from gyre.proxy.records import JournalError
from gyre.proxy.types import ChatRequest, ChatResult

if TYPE_CHECKING:
    from gyre.proxy.server import ProxyServer

log = logging.getLogger("gyre.proxy")


class ProxiedCall:
    """One model call in flight: generation, parsing, streaming, recording."""

    def __init__(self, server: ProxyServer, request: web.Request, api: ModuleType, req: ChatRequest,
                 execution: Recorder, prep: Prepared, max_new: int):
        self.s, self.request, self.api, self.req, self.ex, self.prep = server, request, api, req, execution, prep
        tok = server.tokenizer
        # The run's sampling, whatever the harness asked (its values go into the record).
        self.params = GenParams(max_new_tokens=max_new, temperature=server.config.temperature,
                                top_p=server.config.top_p, stop_token_ids=tuple(sorted(tok.stop_token_ids)))
        self.parser = output_parser(tok, req, api.new_tool_call_id)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.engine = ""
        self.cached_tokens: int | None = None  # the backend's count; None: it did not say
        self.prefill_tokens: int | None = None
        self.finish = "stop"
        self.response_id = api.new_response_id()
        self.recorded = False
        self.unanswered: dict | None = None  # the call's ok record until its answer is out

    async def run(self) -> web.StreamResponse:
        """The except ladder: each outcome is recorded once, with its status."""
        queue: asyncio.Queue = asyncio.Queue()
        pump = asyncio.create_task(self._pump(queue), name=f"gyre-gen-{self.prep.call_id}")
        try:
            if self.req.stream:
                return await self._stream(queue)
            return await self._whole(queue)
        except asyncio.CancelledError:
            # The client went away (or the proxy stopped): stop generating, keep what was
            # produced, marked; an answer recorded but not sent is marked undelivered.
            self._record("disconnected")
            self._undelivered()
            raise
        except (ConnectionResetError, BrokenPipeError):
            self._record("disconnected")
            self._undelivered()
            return web.Response(status=499)
        except JournalError as e:
            # The output's record could not be written (a full disk): taken back whole, and
            # the harness, which has seen nothing of it, retries later.
            self.ex.note_answer(refused=True, why=f"503 the disk is full: {e}")
            return self.s._disk_full(self.api, e)
        except (BackendUnavailable, EngineRefused) as e:
            # No engine at all (503, retryable) or the engine refused the request (400): the
            # call is kept as an error record.
            self._record("error")
            status, message = status_of(e)
            self.ex.note_answer(refused=is_refusal(status), why=f"{status} {message}")
            return api_error(self.api, status, message)
        except Exception as e:  # noqa: BLE001 - recorded and answered, never a silent drop
            log.exception("call %s failed", self.prep.call_id)
            self._record("error")
            self._undelivered()  # recorded ok, then a failure before it went out: the harness gets the 500
            self.ex.note_answer(refused=True, why=f"500 internal error: {type(e).__name__}: {e}")
            return api_error(self.api, 500, f"internal error: {type(e).__name__}: {e}")
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
        return parsed_result(self.parser, self.req, self.response_id, self.finish, len(self.prep.prompt_ids), self.kept)

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
        self.ex.note_answer(refused=False)
        # Sent here, not by aiohttp after the return: a cut while sending is this call's to mark.
        resp = web.json_response(self.api.render_result(result, self.req), dumps=dumps_str)
        await resp.prepare(self.request)
        await resp.write_eof()
        self.unanswered = None
        return resp

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
        try:
            for event in stream.start():
                await resp.write(event)
            while True:
                chunk = await self._next(queue, ping=lambda: resp.write(stream.ping()))
                for d in self._absorb(chunk):
                    for event in stream.delta(d):
                        await resp.write(event)
                if await self._stop_early() or chunk.finished:  # a stop string decides first
                    break
            result = self._result()
            self._record("ok", result)  # before the closing events: a record refused is an error event
        except (asyncio.CancelledError, ConnectionResetError, BrokenPipeError):
            raise  # the client left: run() records it
        except Exception as e:  # noqa: BLE001 - the stream has started: answered in it, recorded
            if isinstance(e, JournalError):
                self.s._disk.note(e)  # nothing of the call recorded; the harness never sees it end
            elif not isinstance(e, (BackendUnavailable, EngineRefused)):
                log.exception("call %s failed mid-stream", self.prep.call_id)
            self._record("error")
            status, message = status_of(e)
            self.ex.note_answer(refused=is_refusal(status), why=f"{status} {message}")
            for event in stream.error(status, message):
                await resp.write(event)
            await resp.write_eof()
            return resp
        self.ex.note_answer(refused=False)
        for event in stream.finish(result):
            await resp.write(event)
        await resp.write_eof()
        self.unanswered = None
        return resp

    def _undelivered(self) -> None:
        """The call was recorded ok but its answer (or its stream's end) never went out: the
        harness saw no answer and retries it, so this output is not trained (Recorder.undelivered)."""
        if self.unanswered is None:
            return
        record, self.unanswered = self.unanswered, None
        try:
            self.ex.undelivered(record)
        except JournalError as e:
            self.s._disk.note(e)

    def _record(self, status: str, result: ChatResult | None = None) -> None:
        if self.recorded:
            return
        self.recorded = True
        n = self.kept  # the recorded output is what the client was given
        self.s.budgets.charge(self.ex.id, len(self.ids))  # what the engine generated, kept or not
        # The record's finish reason is what ended the call: an error or a disconnect, tool
        # calls, else the engine's stop or length.
        finish = status if status != "ok" else "tool_calls" if self.parser.tool_calls else self.finish
        try:
            record = self.ex.complete(self.prep, output_ids=self.ids[:n], logprobs=self.logprobs[:n],
                                      versions=self.versions[:n], finish_reason=finish, status=status,
                                      engine=self.engine, result=result, request=self.req,
                                      invalid_tool_calls=self.parser.invalid_tool_calls,
                                      cached_tokens=self.cached_tokens, prefill_tokens=self.prefill_tokens,
                                      sampling={"temperature": self.params.temperature, "top_p": self.params.top_p,
                                                "client_temperature": self.req.temperature,
                                                "client_top_p": self.req.top_p,
                                                "max_tokens": self.params.max_new_tokens,
                                                "client_max_tokens": self.req.max_tokens})
        except JournalError as e:
            if status == "ok":
                raise  # the caller answers 503 (or an error event) instead of the result
            self.s._disk.note(e)  # an error or disconnect record lost whole: nothing half-written
            return
        if status == "ok":
            self.unanswered = record
        if self.s.on_record is not None:
            self.s.on_record(self.ex, record)


def dumps_str(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def api_error(api: ModuleType, status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return json_error(status, api.error_body(status, message), headers)


def http_error(api: ModuleType, e: HttpError) -> web.Response:
    body = api.overloaded_body(e.message) if e.overloaded else api.error_body(e.status, e.message)
    resp = json_error(e.status, body, e.headers)
    if e.close:
        resp.force_close()
    return resp


def json_error(status: int, body: dict, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json", headers=headers)


def is_refusal(status: int) -> bool:
    """Whether an answer with this status is gyre's own refusal (Recorder.refusals): a 429
    or a 5xx; every other 4xx is the agent's request."""
    return status == 429 or status >= 500


def status_of(e: Exception) -> tuple[int, str]:
    """The status and message a failure during generation is answered with."""
    if isinstance(e, BackendUnavailable):
        return 503, f"no rollout engine available: {e}"
    if isinstance(e, JournalError):
        return 503, f"the proxy cannot record calls now: {e}"
    if isinstance(e, EngineRefused):
        return 400, f"the engine refused the request: {e}"
    return 500, f"internal error: {type(e).__name__}: {e}"

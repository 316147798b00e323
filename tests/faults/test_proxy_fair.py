"""One execution cannot starve the rest, and gyre's own refusals are counted (issue 36,
findings 6 and 7): each execution has a budget of calls in flight (and of tokens per
minute); a call over it waits its turn, then is a 429 in the provider's shape with
retry-after, while other executions are served; every answer that was gyre's own refusal
(429, 503) is counted on the execution's Recorder, an agent's own overflow or bad input
is not. A real ProxyServer on 127.0.0.1 with the scripted engine (or no engine) behind it."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest

from gyre.proxy.backend import BackendUnavailable
from gyre.proxy.budget import Budgets
from gyre.proxy.server import ProxyConfig, ProxyServer
from tests.scripted import ScriptedEngine
from tests.support import ThreadEngineBackend

CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"


class HoldingEngine(ScriptedEngine):
    """The scripted engine, holding every request whose prompt says FLOOD until `flood_go` is
    set; counts how many such requests it ever ran at once."""

    def __post_init__(self):
        super().__post_init__()
        self.flood_go = threading.Event()
        self.flooding: set[str] = set()
        self.most_flooding = 0
        self.flood_seen = 0

    def add_request(self, rid, prompt_ids, params) -> None:
        super().add_request(rid, prompt_ids, params)
        if "FLOOD" in self.tokenizer.decode(prompt_ids):
            self.flooding.add(rid)
            self.flood_seen += 1
            self.most_flooding = max(self.most_flooding, len(self.flooding))

    def step(self):
        if self.flood_go.is_set():
            outs = super().step()
        else:
            held = {rid: self._running.pop(rid) for rid in list(self._running) if rid in self.flooding}
            try:
                outs = super().step()
            finally:
                self._running.update(held)
        for out in outs:
            if out.finished:
                self.flooding.discard(out.rid)
        return outs


def body_for(path: str, text: str, stream: bool = False) -> dict:
    if path == MESSAGES:
        return {"model": "m", "max_tokens": 8, "stream": stream, "messages": [{"role": "user", "content": text}]}
    if path == RESPONSES:
        return {"model": "m", "max_output_tokens": 8, "stream": stream, "input": text}
    return {"model": "m", "max_tokens": 8, "stream": stream, "messages": [{"role": "user", "content": text}]}


def headers_for(path: str, key: str) -> dict:
    return {"x-api-key": key} if path == MESSAGES else {"Authorization": f"Bearer {key}"}


async def post(session: aiohttp.ClientSession, url: str, path: str, key: str, body: dict):
    async with session.post(url + path, json=body, headers=headers_for(path, key)) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.json()


async def open_stream(session: aiohttp.ClientSession, url: str, path: str, key: str, opened: asyncio.Queue) -> int:
    """A streamed call: its headers mean it was admitted (put on `opened`); read to its end."""
    async with session.post(url + path, json=body_for(path, "FLOOD", stream=True), headers=headers_for(path, key)) as r:
        await opened.put(r.status)
        await r.read()
        return r.status


@pytest.fixture
async def make_proxy(chat_tokenizer, tmp_path):
    made = []

    async def make(backend=None, **config):
        engine = HoldingEngine(chat_tokenizer)
        backend = backend or ThreadEngineBackend(engine, sampling_cls=lambda **kw: kw)
        server = ProxyServer(chat_tokenizer, backend, ProxyConfig(**config), run_dir=tmp_path / f"run{len(made)}")
        url = await server.start()
        made.append((server, backend))
        return server, engine, url

    yield make
    for server, backend in made:
        await server.stop()
        if isinstance(backend, ThreadEngineBackend):
            backend.engine.flood_go.set()
            backend.close()


async def test_a_flooding_execution_keeps_to_its_budget_and_its_neighbour_is_served(make_proxy):
    """32 concurrent calls of one execution: 4 run (its budget), the other 28 wait their
    turn; meanwhile a neighbour's calls are served one after another. Once the flood's calls
    may finish, all 32 are served, never more than 4 at once."""
    server, engine, url = await make_proxy(max_calls_in_flight_per_execution=4, budget_wait_s=120)
    flood, neighbour = server.register("flood"), server.register("neighbour")
    opened: asyncio.Queue = asyncio.Queue()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        tasks = [asyncio.create_task(open_stream(s, url, CHAT, flood.key, opened)) for _ in range(32)]
        for _ in range(4):
            assert await opened.get() == 200
        for i in range(3):
            status, _, body = await post(s, url, MESSAGES, neighbour.key, body_for(MESSAGES, f"hello {i}"))
            assert status == 200 and body["type"] == "message"
        assert opened.empty() and engine.flood_seen == 4 and server.budgets.in_flight("flood") == 4
        assert len(neighbour.calls) == 3 and not neighbour.refusals
        engine.flood_go.set()
        assert await asyncio.gather(*tasks) == [200] * 32
    assert engine.most_flooding == 4 and engine.flood_seen == 32 and len(flood.calls) == 32
    assert flood.refusals == 0 and not flood.refused_last


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
async def test_a_call_past_the_budget_is_a_429_in_the_provider_shape_and_counted_as_a_refusal(make_proxy, path):
    """Two calls in flight (held), a third waits budget_wait_s and is refused: 429 with
    retry-after in the API's own rate-limit shape, counted on the Recorder as gyre's refusal;
    a neighbour is served meanwhile; a later served call of the flooder clears refused_last."""
    server, engine, url = await make_proxy(max_calls_in_flight_per_execution=2, budget_wait_s=0.3)
    flood, neighbour = server.register("flood"), server.register("neighbour")
    opened: asyncio.Queue = asyncio.Queue()
    async with aiohttp.ClientSession() as s:
        held = [asyncio.create_task(open_stream(s, url, path, flood.key, opened)) for _ in range(2)]
        assert [await opened.get(), await opened.get()] == [200, 200]
        status, headers, body = await post(s, url, path, flood.key, body_for(path, "one more"))
        assert status == 429 and int(headers["retry-after"]) >= 1
        if path == MESSAGES:
            assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
        else:
            assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "requests"
        assert "max_calls_in_flight_per_execution" in body["error"]["message"]
        assert flood.refusals == 1 and flood.refused_last and len(flood.calls) == 0
        status, _, _ = await post(s, url, path, neighbour.key, body_for(path, "hi"))
        assert status == 200 and neighbour.refusals == 0
        engine.flood_go.set()
        assert await asyncio.gather(*held) == [200, 200]
        status, _, _ = await post(s, url, path, flood.key, body_for(path, "again"))
        assert status == 200
    assert flood.refusals == 1 and not flood.refused_last and len(flood.calls) == 3


async def test_past_its_tokens_per_minute_an_execution_gets_a_429_naming_the_tokens(make_proxy):
    server, _, url = await make_proxy(max_tokens_per_minute_per_execution=20, budget_wait_s=0)
    ex, other = server.register("spender"), server.register("other")
    async with aiohttp.ClientSession() as s:
        status, _, _ = await post(s, url, CHAT, ex.key, body_for(CHAT, "a prompt of more than twenty tokens"))
        assert status == 200  # the bucket was full: let in, charged its prompt and output
        status, headers, body = await post(s, url, CHAT, ex.key, body_for(CHAT, "and another"))
        assert status == 429 and body["error"]["type"] == "tokens" and int(headers["retry-after"]) >= 1
        assert "max_tokens_per_minute_per_execution" in body["error"]["message"]
        status, _, _ = await post(s, url, CHAT, other.key, body_for(CHAT, "hi"))
        assert status == 200
    assert ex.refusals == 1 and ex.refused_last and other.refusals == 0


class NoEngine:
    """A backend with no engine to route to (every engine gone)."""

    async def generate(self, rid, prompt_ids, params, execution=None):
        raise BackendUnavailable("no rollout engine is up")
        yield  # an async generator

    async def abort(self, rid: str) -> None:
        pass

    def forget(self, execution: str) -> None:
        pass


async def test_503s_are_counted_as_refusals_and_the_agents_own_errors_are_not(make_proxy):
    """No engine (503, plain and mid-stream) and the disk guard (503) count; a context overflow
    and a malformed request, the agent's own, do not, and they clear refused_last."""
    server, _, url = await make_proxy(backend=NoEngine(), max_context=512)
    ex = server.register("e")
    async with aiohttp.ClientSession() as s:
        status, _, body = await post(s, url, MESSAGES, ex.key, body_for(MESSAGES, "hi"))
        assert status == 503 and ex.refusals == 1 and ex.refused_last
        status, _, body = await post(s, url, CHAT, ex.key, body_for(CHAT, "word " * 600))
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
        assert ex.refusals == 1 and not ex.refused_last
        async with s.post(url + CHAT, json=body_for(CHAT, "hi", stream=True), headers=headers_for(CHAT, ex.key)) as r:
            assert r.status == 200 and b"no rollout engine" in await r.read()
        assert ex.refusals == 2 and ex.refused_last
        status, _, body = await post(s, url, CHAT, ex.key, {"model": "m", "messages": "hi"})
        assert status == 400 and ex.refusals == 2 and not ex.refused_last
    disk_full, _, url = await make_proxy(min_free_disk_bytes=1 << 62)
    ex = disk_full.register("e")
    async with aiohttp.ClientSession() as s:
        status, headers, body = await post(s, url, MESSAGES, ex.key, body_for(MESSAGES, "hi"))
        assert status == 503 and body["error"]["type"] == "overloaded_error" and "retry-after" in headers
    assert ex.refusals == 1 and ex.refused_last and ex.calls == []


async def test_a_waiter_that_leaves_after_being_handed_a_slot_passes_it_on():
    """A call waiting its turn whose client goes away just as a slot is handed to it: the
    slot goes to the next waiter, never lost (else the execution would be locked out)."""
    budgets = Budgets(max_in_flight=1, wait_s=60)
    await budgets.admit("e")
    first, second = asyncio.create_task(budgets.admit("e")), asyncio.create_task(budgets.admit("e"))
    while len(budgets._shares["e"].waiters) < 2:
        await asyncio.sleep(0)  # (a turn of the loop: both are queued)
    budgets.release("e")  # handed to `first` ...
    first.cancel()  # ... whose client leaves before it runs
    await second
    assert first.cancelled() and budgets.in_flight("e") == 1
    budgets.release("e")
    assert budgets.in_flight("e") == 0

"""A live proxy on 127.0.0.1 with the scripted engine (or the real CPU engine) behind it; errors injectable."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gyre.proxy.server import ProxyConfig
from tests.scripted import ScriptedEngine
from tests.support import FaultyProxyServer, ThreadEngineBackend


@dataclass
class Live:
    server: FaultyProxyServer
    engine: ScriptedEngine
    backend: ThreadEngineBackend
    url: str

    def execution(self, name: str = "e1"):
        return self.server.register(name)


@pytest.fixture
async def live(chat_tokenizer, tmp_path):
    engine = ScriptedEngine(chat_tokenizer)
    backend = ThreadEngineBackend(engine, sampling_cls=lambda **kw: kw)
    server = FaultyProxyServer(chat_tokenizer, backend, ProxyConfig(max_body_bytes=256 * 1024, ping_interval_s=0.2),
                               run_dir=tmp_path / "run")
    url = await server.start()
    yield Live(server, engine, backend, url)
    await server.stop()
    backend.close()


@pytest.fixture
async def clients():
    """Build SDK clients through this; they are closed at teardown (no leaked sockets)."""
    made = []

    def make(cls, **kw):
        c = cls(**kw)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()

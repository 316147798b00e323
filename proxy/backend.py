"""backend.py: where the proxy's generations run, behind one small async interface.

`Backend.generate` streams chunks (token ids, log-probs, policy version) for one request
and `abort` stops it. The coordinator implements it over its ZeroMQ routing table
(coordinator/routing.py); tests drive an in-process engine behind it (tests/support.py).
Not a router: choosing an engine is the coordinator's job.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol


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

"""backend.py: where the proxy's generations run, behind one small async interface.

`Backend.generate` streams chunks (token ids, log-probs, policy version) for one request
of one execution (its id lets the backend keep an execution's calls on the engine that
holds its history's KV) and `abort` stops it; `forget` says the execution ended. The
coordinator implements it over its ZeroMQ routing table (coordinator/routing.py); tests
drive an in-process engine behind it (tests/support.py).
Not a router: choosing an engine is the coordinator's job.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np


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
    # The call's prefill so far: prompt tokens whose KV was reused, and those computed (over
    # every engine it ran on); None: an engine did not say.
    cached_tokens: int | None = None
    prefill_tokens: int | None = None


class BackendUnavailable(RuntimeError):
    """No engine can take the request now (all dead or draining); answered with 503."""


class EngineRefused(ValueError):
    """The engine refused the request itself (a prompt past its context, ids outside its
    vocabulary): the request's fault, answered 400 like any bad request, never a 5xx."""


class Backend(Protocol):
    # `prompt_ids`: a numpy array of ids (uint16 or int32, the tree's dtype); not to be written.
    def generate(self, rid: str, prompt_ids: np.ndarray, params: GenParams,
                 execution: str | None = None) -> AsyncIterator[Chunk]: ...

    async def abort(self, rid: str) -> None: ...

    def forget(self, execution: str) -> None: ...

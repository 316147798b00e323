"""engines/base.py: the rollout-engine interface every backend implements (CPU, SGLang).

The workerd drives an engine with `add_request` / `abort` and calls `step()` whenever
it has work; each call advances running requests and returns the tokens produced since
the last call. Not a scheduler of executions: that is the coordinator's job.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gyre.workerd.model import SeqCache


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(slots=True, kw_only=True)
class TokenOutput:
    """Tokens one request produced in one `step()`; `finished` on its last output.

    `logprobs` are behaviour log-probs of the sampled tokens under the distribution they
    were drawn from: the model's logits divided by the request's temperature (temperature 0,
    greedy, reports temperature 1's), renormalised over the top-p set when top_p < 1. The
    trainer recomputes them at the same temperature (it cannot reproduce a top-p cut, which
    is why training runs refuse rollout_top_p < 1 unless told otherwise).
    """

    rid: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version: int = 0
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    prompt_tokens: int = 0
    # Prompt tokens whose KV was reused, not computed (prefix cache, handed-over KV); on every
    # output once the engine knows it; None: the engine cannot say.
    cached_tokens: int | None = None


class RolloutEngine(abc.ABC):
    """What the worker drives; every backend subclasses it. The abstract methods are the
    contract; the others are capabilities a backend may lack, with the lacking behaviour
    as their default, so the worker calls them on any engine."""

    version: int

    @abc.abstractmethod
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None: ...

    @abc.abstractmethod
    def abort(self, rid: str) -> TokenOutput | None:
        """Stop `rid` now; returns its final (finish_reason="abort") output if it was known."""

    @abc.abstractmethod
    def step(self) -> list[TokenOutput]: ...

    @property
    @abc.abstractmethod
    def running(self) -> int: ...

    @abc.abstractmethod
    def release_memory(self) -> int:
        """Free KV caches (and, on GPUs, weights) for a role change; returns bytes freed."""

    @abc.abstractmethod
    def resume_memory(self) -> None: ...

    @abc.abstractmethod
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Load HF-named tensors; returns bytes loaded. Called between steps only."""

    def holds(self, version: int) -> bool:
        """Whether the engine's weights are `version`'s now (a publication of unchanged
        weights then loads nothing). The default: its version says so (the weights stay
        resident across a release); an engine whose release drops them says otherwise."""
        return self.version == version

    def export_kv(self, rid: str) -> SeqCache | None:
        """The KV of a running request's context so far, for continuing it on another engine
        (Worker.abort_all calls it before `abort` on a hand-over). The default, None: this
        engine cannot hand its KV over, and the next one recomputes the prefill."""
        return None

    def cache_stats(self) -> dict[str, int]:
        """The engine's own prefix cache's counters (engines/prefix_cache.py names them). The
        default, {}: it keeps none, or does not say (SGLang reports per request only)."""
        return {}

    def shutdown(self) -> None:  # noqa: B027 - a no-op by default, not abstract
        """Stop what the engine runs outside this process (Worker.reset calls it before
        dropping the engine). The default: an engine that holds nothing there."""

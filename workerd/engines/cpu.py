"""engines/cpu.py: the embedded rollout engine, a real batched sampler on CPU.

Each `step()` first prefills the requests that arrived since the last step, then runs
one batched decode step over every other running request (continuous batching: requests
join and leave between steps). Behaviour log-probs come from the same `CausalLM` the
trainer uses. A prefix cache (engines/prefix_cache.py) keeps the KV of finished requests,
so a prompt that extends an earlier sequence (an agent's next turn) prefills only what is
new. Not thread-safe: the workerd's main loop is its only caller.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from gyre.workerd.engines.base import RolloutEngine, SamplingParams, TokenOutput
from gyre.workerd.engines.prefix_cache import PrefixCache, copy_prefix
from gyre.workerd.model import CausalLM, SeqCache
from gyre.workerd.wire import EngineSpec

_DEFAULT = EngineSpec()  # the options' defaults, written once (wire/messages.py)


class EngineReleased(RuntimeError):
    """The engine's memory was released for training; it takes no requests until resumed."""


@dataclass(slots=True)
class _Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    epoch: int  # the engine's weights epoch when its KV began: older KV is never cached
    cache: SeqCache = field(default_factory=SeqCache)
    cached: int = 0  # prompt tokens whose KV was reused (prefix cache or handed over)
    exported: bool = False  # its KV left with export_kv: it is not the cache's to keep
    output_ids: list[int] = field(default_factory=list)
    last_token: int = -1


class CpuEngine(RolloutEngine):
    """Rollout engine over a `CausalLM` on CPU; see engines/base.py for the contract."""

    def __init__(self, model: CausalLM, *, version: int = 0, max_running: int = _DEFAULT.max_running,
                 seed: int = _DEFAULT.seed, prefix_cache_bytes: int = _DEFAULT.prefix_cache_mb << 20):
        """`prefix_cache_bytes`: the prefix cache's budget; 0 turns it off."""
        self.model = model.eval()
        self.version = version
        self.max_running = max_running
        self.max_context = model.config.max_position_embeddings
        self._generator = torch.Generator().manual_seed(seed)
        self._waiting: dict[str, _Request] = {}
        self._running: dict[str, _Request] = {}
        self._released = False
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self._epoch = 0  # bumped by load_weights

    @property
    def running(self) -> int:
        return len(self._waiting) + len(self._running)

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                    kv: SeqCache | None = None) -> None:
        """`kv`, if given, holds the KV of a prefix of `prompt_ids` (handed over from another
        engine): only the tokens after it are prefilled."""
        if self._released:
            raise EngineReleased("engine memory is released (cell is training)")
        if rid in self._waiting or rid in self._running:
            raise ValueError(f"request id {rid!r} is already running")
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt_ids outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_context:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds the context {self.max_context}")
        if kv is not None and not 0 < kv.length < len(prompt_ids):
            raise ValueError(f"handed-over KV covers {kv.length} tokens of a {len(prompt_ids)}-token prompt")
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        req = _Request(rid, list(prompt_ids), params, gen, self._epoch)
        if kv is not None:
            req.cache, req.cached = kv, kv.length
        self._waiting[rid] = req

    def abort(self, rid: str) -> TokenOutput | None:
        req = self._waiting.pop(rid, None) or self._running.pop(rid, None)
        if req is None:
            return None
        self._keep(req)
        return self._out(req, [], [], finished=True, reason="abort")

    def export_kv(self, rid: str) -> SeqCache | None:
        """The KV of a running request's context so far (prompt + all sampled tokens but the
        last, which is not fed yet), for continuing it elsewhere. Call before `abort`."""
        req = self._running.get(rid)
        if req is None or req.cache.length == 0:
            return None
        req.exported = True
        return req.cache

    def step(self) -> list[TokenOutput]:
        outputs: list[TokenOutput] = []
        # 1) Requests already decoding advance by one token together.
        if self._running:
            reqs = list(self._running.values())[: self.max_running]
            ids = torch.tensor([r.last_token for r in reqs])
            logits = self.model.decode(ids, [r.cache for r in reqs])
            outputs += self._sample(reqs, logits)
        # 2) New requests are prefilled and sample their first token.
        while self._waiting and len(self._running) < self.max_running:
            rid, req = next(iter(self._waiting.items()))
            del self._waiting[rid]
            # The cache is asked at prefill, not on arrival: a prompt that arrived with others
            # sharing its prefix (a group's executions of one task) reuses the KV the first
            # of them just computed. A handed-over cache holds the prompt's first tokens already.
            if req.cache.length == 0 and self.prefix_cache is not None and req.epoch == self._epoch:
                kv = self.prefix_cache.lookup(req.prompt_ids)
                if kv is not None:
                    req.cache, req.cached = kv, kv.length
            logits = self.model.extend(torch.tensor(req.prompt_ids[req.cache.length:]), req.cache)[-1:]
            self._share(req)
            self._running[rid] = req
            outputs += self._sample([req], logits)
        return outputs

    def _sample(self, reqs: list[_Request], logits: torch.Tensor) -> list[TokenOutput]:
        # The distribution each request samples from: logits / T (T = 0, greedy, reports T = 1's).
        temps = torch.tensor([r.params.temperature or 1.0 for r in reqs], dtype=torch.float32)
        logprobs = torch.log_softmax(logits.float() / temps[:, None], dim=-1)
        outs = []
        for i, req in enumerate(reqs):
            token, lp = self._draw(logprobs[i], req)
            req.output_ids.append(token)
            req.last_token = token
            p = req.params
            reason = None
            if token in p.stop_token_ids:
                reason = "stop"
            elif len(req.output_ids) >= p.max_new_tokens or req.cache.length + 1 >= self.max_context:
                reason = "length"
            if reason:
                del self._running[req.rid]
                self._keep(req)
            outs.append(self._out(req, [token], [lp], finished=reason is not None, reason=reason))
        return outs

    def _draw(self, logprobs: torch.Tensor, req: _Request) -> tuple[int, float]:
        """(token, its behaviour log-prob): the log-prob under the distribution it was drawn
        from, the temperature-scaled one, renormalised over the top-p set when top_p < 1."""
        p = req.params
        if p.temperature == 0:
            token = int(logprobs.argmax())
            return token, float(logprobs[token])
        probs = logprobs.exp()
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # always keeps the top token
            kept = order[keep]
            probs = torch.zeros_like(probs).scatter_(0, kept, sorted_p[keep])
            token = int(torch.multinomial(probs, 1, generator=req.generator or self._generator))
            return token, float(logprobs[token] - torch.logsumexp(logprobs[kept], 0))
        token = int(torch.multinomial(probs, 1, generator=req.generator or self._generator))
        return token, float(logprobs[token])

    def _out(self, req: _Request, ids, lps, *, finished: bool, reason: str | None) -> TokenOutput:
        return TokenOutput(rid=req.rid, token_ids=ids, logprobs=lps, version=self.version,
                           finished=finished, finish_reason=reason, prompt_tokens=len(req.prompt_ids),
                           cached_tokens=req.cached)

    def _keep(self, req: _Request) -> None:
        """A request that ended: its KV goes to the prefix cache, unless it left with export_kv
        or was computed (partly) by weights older than the current ones."""
        if self.prefix_cache is not None and not req.exported and req.epoch == self._epoch:
            # The cache covers prompt + output but the last sampled token (never fed).
            self.prefix_cache.insert((req.prompt_ids + req.output_ids)[: req.cache.length], req.cache)

    def _share(self, req: _Request) -> None:
        """A prompt just prefilled: a copy of its KV goes to the cache now, so requests
        waiting with the same prefix skip it (unless an entry covers it already)."""
        c = self.prefix_cache
        if c is None or req.epoch != self._epoch or c.covers(req.prompt_ids):
            return
        n = req.cache.length
        c.insert(req.prompt_ids[:n], copy_prefix(req.cache, n, capacity=n))

    def cache_stats(self) -> dict[str, int]:
        return self.prefix_cache.stats() if self.prefix_cache is not None else {}

    # --- role changes and weights -------------------------------------------------------

    def release_memory(self) -> int:
        if self.running:
            raise RuntimeError(f"release_memory with {self.running} requests running: abort them first")
        self._released = True
        # Running requests' caches died with them; weights stay resident on CPU.
        return self.prefix_cache.flush() if self.prefix_cache is not None else 0

    def resume_memory(self) -> None:
        self._released = False

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        nbytes = self.model.load_hf_weights(named)
        self.version = version
        # KV computed by the old weights never serves the new ones: cached or still running.
        self._epoch += 1
        if self.prefix_cache is not None:
            self.prefix_cache.flush()
        return nbytes

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV held: requests' (waiting ones may hold a reused prefix) and the cache's."""
        held = sum(r.cache.nbytes for r in (*self._waiting.values(), *self._running.values()))
        return held + (self.prefix_cache.bytes if self.prefix_cache is not None else 0)

"""engines/prefix_cache.py: `PrefixCache`, the KV of finished requests kept for prompts that extend them.

An agent's next call sends its whole conversation again: turn k's prompt is turn k-1's
prompt and output plus new tokens. The CPU engine keeps each finished request's `SeqCache`
here, keyed by the tokens it covers, and a new prompt reuses the KV of its longest common
prefix (LCP) with any entry: KV at position i depends on tokens 0..i only, so an entry's
first m positions serve every prompt that shares those m tokens.

Bounded by a byte budget, least recently used out first. Bytes are the SeqCache buffers'
real size, capacity included (entries are kept as the request left them, not compacted:
no copy on insert, and a request that extends an entry grows it in place).

Not a radix tree: entries are whole sequences, no entry is a prefix of another, and a
lookup compares the prompt with each (numpy, one vectorised compare per entry). Not shared
between engines and not thread-safe: the engine's one caller drives it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count

import numpy as np

from gyre.workerd.model import SeqCache


@dataclass(slots=True, eq=False)
class _Entry:
    tokens: np.ndarray  # int32: the tokens whose KV `cache` holds, len == cache.length
    cache: SeqCache
    nbytes: int


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = a[:n] != b[:n]
    first = int(differ.argmax())
    return first if differ[first] else n


def copy_prefix(cache: SeqCache, n: int, capacity: int) -> SeqCache:
    """A new SeqCache holding the first n positions of `cache`, with room for `capacity`."""
    out = SeqCache(length=n)
    for src, dst in ((cache.k, out.k), (cache.v, out.v)):
        for buf in src:
            new = buf.new_empty(buf.shape[0], max(capacity, n), buf.shape[2])
            new[:, :n] = buf[:, :n]
            dst.append(new)
    return out


class PrefixCache:
    """KV of finished sequences under `budget_bytes`; see the module docstring."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._keys = count()
        self.bytes = 0
        self.lookups = self.hits = self.tokens_reused = self.tokens_looked_up = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt_ids: Sequence[int]) -> SeqCache | None:
        """The KV of `prompt_ids`' longest cached prefix, at most len(prompt_ids) - 1 tokens
        (the last prompt token is always prefilled: its logits sample the first output), or
        None. The caller owns the result (`length` says how many tokens it covers) and may
        append to it: an entry the prompt extends moves out of the cache (it comes back, longer,
        with `insert`); one it shares a prefix with, or equals, stays, and its prefix is copied."""
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        self.lookups += 1
        self.tokens_looked_up += len(prompt)
        key, m = self._longest(prompt)
        reuse = min(m, len(prompt) - 1)
        if key is None or reuse <= 0:
            return None
        entry = self._entries[key]
        if m == len(entry.tokens) < len(prompt):  # the prompt extends it: the agent's next call
            del self._entries[key]
            self.bytes -= entry.nbytes
            cache = entry.cache
        else:  # a shared prefix (or the same prompt again: others may want it too)
            self._entries.move_to_end(key)
            # Room for the whole prompt, as a fresh prefill's first append allocates.
            cache = copy_prefix(entry.cache, reuse, capacity=max(64, 2 * len(prompt)))
        self.hits += 1
        self.tokens_reused += reuse
        return cache

    def insert(self, token_ids: Sequence[int], cache: SeqCache) -> bool:
        """Keep `cache`, whose first `cache.length` positions hold the KV of those tokens of
        `token_ids`; the cache owns it from here (the caller must not append to it). Entries
        the new one extends are dropped. False: not kept (it is empty, larger than the whole
        budget, or a prefix of an entry, which is refreshed instead)."""
        n = cache.length
        nbytes = cache.nbytes
        if n == 0 or nbytes > self.budget_bytes:
            return False
        tokens = np.asarray(token_ids[:n], dtype=np.int32)
        if len(tokens) != n:
            raise ValueError(f"a SeqCache of {n} positions for {len(tokens)} tokens")
        for key, e in list(self._entries.items()):
            m = lcp(e.tokens, tokens)
            if m == n:  # covered by an entry already (or equal to it)
                self._entries.move_to_end(key)
                return False
            if m == len(e.tokens):  # the new one extends it
                del self._entries[key]
                self.bytes -= e.nbytes
        self._entries[next(self._keys)] = _Entry(tokens, cache, nbytes)
        self.bytes += nbytes
        while self.bytes > self.budget_bytes:  # stops at the new entry: it alone fits
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.evictions += 1
        return True

    def covers(self, token_ids: Sequence[int]) -> bool:
        """Whether an entry holds the KV of all of `token_ids` (inserting them would keep nothing)."""
        tokens = np.asarray(token_ids, dtype=np.int32)
        return any(len(e.tokens) >= len(tokens) and lcp(e.tokens, tokens) == len(tokens)
                   for e in self._entries.values())

    def flush(self) -> int:
        """Drop every entry (new weights, or the memory goes to training); returns bytes freed."""
        freed, self.bytes = self.bytes, 0
        self._entries.clear()
        return freed

    def stats(self) -> dict[str, int]:
        return {"lookups": self.lookups, "hits": self.hits, "tokens_reused": self.tokens_reused,
                "tokens_looked_up": self.tokens_looked_up, "evictions": self.evictions,
                "bytes": self.bytes, "entries": len(self._entries), "budget_bytes": self.budget_bytes}

    def _longest(self, prompt: np.ndarray) -> tuple[int | None, int]:
        """(key, LCP) of the entry sharing the longest prefix with `prompt`; ties go to the
        most recently used."""
        best_key, best = None, 0
        for key in reversed(self._entries):
            e = self._entries[key]
            if len(e.tokens) <= best:
                continue  # cannot share more than it holds
            m = lcp(e.tokens, prompt)
            if m > best:
                best_key, best = key, m
                if best == len(prompt):
                    break
        return best_key, best


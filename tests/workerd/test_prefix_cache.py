"""The CPU engine's prefix cache: multi-turn outputs are exact with it (greedy and seeded
sampling), cached_tokens says what was reused, a handed-over request seeds the destination's
cache, and the cache keeps to its budget (LRU), flushes on a role change and on new weights,
and never corrupts an entry it copies from. PrefixCache's match against a brute-force LCP."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.workerd.engines.base import SamplingParams
from gyre.workerd.engines.cpu import CpuEngine
from gyre.workerd.engines.prefix_cache import PrefixCache, lcp
from gyre.workerd.model import SeqCache

GREEDY = SamplingParams(max_new_tokens=16, temperature=0)


def run(engine: CpuEngine) -> dict[str, tuple[list[int], list[float], set]]:
    """rid -> (tokens, log-probs, the cached_tokens values its outputs carried)."""
    out: dict[str, tuple[list[int], list[float], set]] = {}
    while engine.running:
        for o in engine.step():
            ids, lps, cached = out.get(o.rid, ([], [], set()))
            out[o.rid] = (ids + o.token_ids, lps + o.logprobs, cached | {o.cached_tokens})
    return out


def one(engine: CpuEngine, rid: str, prompt: list[int], params: SamplingParams = GREEDY):
    engine.add_request(rid, prompt, params)
    ids, lps, cached = run(engine)[rid]
    [n] = cached  # every output of a request says the same
    return ids, lps, n


def turns(engine: CpuEngine, k: int, params=lambda i: GREEDY) -> list[tuple[list[int], list[float], int]]:
    """An agent's k calls: each prompt is the last one, its output, and a new user message."""
    prompt, got = list(b"system: be brief. user: hello"), []
    for i in range(k):
        ids, lps, cached = one(engine, f"t{i}", prompt, params(i))
        got.append((ids, lps, cached))
        prompt = prompt + ids + list(f" user: turn {i}".encode())
    return got


def assert_same(a, b) -> None:
    for (ids_a, lps_a, _), (ids_b, lps_b, _) in zip(a, b, strict=True):
        assert ids_a == ids_b
        assert torch.allclose(torch.tensor(lps_a), torch.tensor(lps_b), atol=1e-5)


# --- exactness ------------------------------------------------------------------------------

def test_multi_turn_greedy_is_exact_and_reuses_the_last_turn(tiny_model):
    plain = turns(CpuEngine(tiny_model, prefix_cache_bytes=0), 4)
    engine = CpuEngine(tiny_model)
    cached = turns(engine, 4)
    assert_same(plain, cached)
    assert [c for _, _, c in plain] == [0, 0, 0, 0]
    # Turn k reuses turn k-1's prompt and output but its last token (never fed).
    prompt_len = len(b"system: be brief. user: hello")
    expected = [0]
    for i, (ids, _, _) in enumerate(cached[:-1]):
        expected.append(prompt_len + len(ids) - 1)
        prompt_len += len(ids) + len(f" user: turn {i}".encode())
    assert [c for _, _, c in cached] == expected
    stats = engine.cache_stats()
    assert stats["hits"] == 3 and stats["tokens_reused"] == sum(expected)
    assert stats["entries"] == 1  # each turn took the last one's entry and put it back longer


def test_seeded_sampling_is_identical_with_the_cache(tiny_model):
    params = lambda i: SamplingParams(max_new_tokens=16, temperature=0.9, seed=100 + i)  # noqa: E731
    plain = turns(CpuEngine(tiny_model, prefix_cache_bytes=0), 3, params)
    cached = turns(CpuEngine(tiny_model), 3, params)
    assert_same(plain, cached)
    assert all(c > 0 for _, _, c in cached[1:])


def test_concurrent_executions_batch_and_hit_their_own_entries(tiny_model):
    """Two conversations decode together; each next turn hits its own last turn."""
    engine = CpuEngine(tiny_model)
    first = {"a": list(b"conversation a"), "b": list(b"conversation b, longer")}
    for rid, p in first.items():
        engine.add_request(rid, p, GREEDY)
    out = run(engine)
    nxt = {rid: first[rid] + out[rid][0] + list(b" more") for rid in first}
    for rid, p in nxt.items():
        engine.add_request(rid + "2", p, GREEDY)
    got = run(engine)
    for rid, p in nxt.items():
        assert got[rid + "2"][2] == {len(first[rid]) + len(out[rid][0]) - 1}
        ids, lps, _ = one(CpuEngine(tiny_model, prefix_cache_bytes=0), "x", p)
        assert got[rid + "2"][0] == ids
        assert torch.allclose(torch.tensor(got[rid + "2"][1]), torch.tensor(lps), atol=1e-5)


def test_a_prompt_equal_to_a_cached_sequence_reuses_all_but_its_last_token(tiny_model):
    engine = CpuEngine(tiny_model)
    prompt = list(b"the same again")
    ids, _, _ = one(engine, "a", prompt)
    seq = (prompt + ids)[:-1]  # exactly what the entry covers
    got = one(engine, "b", seq)
    assert got[2] == len(seq) - 1
    assert got[0] == one(CpuEngine(tiny_model, prefix_cache_bytes=0), "x", seq)[0]


def test_a_branch_copies_and_leaves_the_entry_whole(tiny_model):
    """A prompt sharing only part of an entry gets a copy of that part; a later prompt that
    extends the whole entry still hits all of it, with exact outputs."""
    engine, plain = CpuEngine(tiny_model), CpuEngine(tiny_model, prefix_cache_bytes=0)
    prompt = list(b"a shared trunk of tokens")
    ids, _, _ = one(engine, "a", prompt)
    entry = (prompt + ids)[:-1]
    branch = entry[:10] + list(b"!! a different branch")
    got = one(engine, "b", branch)
    assert got[2] == 10 and got[0] == one(plain, "x", branch)[0]
    assert engine.cache_stats()["entries"] == 2  # the trunk, and the branch once it finished
    extend = prompt + ids + list(b" next")
    got = one(engine, "c", extend)
    assert got[2] == len(entry)
    ref = one(plain, "y", extend)
    assert got[0] == ref[0] and torch.allclose(torch.tensor(got[1]), torch.tensor(ref[1]), atol=1e-5)


def test_identical_sequences_are_kept_once(tiny_model):
    engine = CpuEngine(tiny_model)
    for rid in ("a", "b"):
        engine.add_request(rid, list(b"twins"), GREEDY)
    out = run(engine)
    assert out["a"][0] == out["b"][0]
    assert engine.cache_stats()["entries"] == 1


# --- hand-over, abort, role changes, weights ------------------------------------------------

def test_a_handed_over_request_seeds_the_destination_cache(tiny_model, tiny_dir):
    """A runs a request, exports its KV and aborts it (a role change); B finishes it from
    that KV; the execution's next call then hits B's cache for all it has seen."""
    from gyre.workerd.model import load_model

    a, b = CpuEngine(tiny_model), CpuEngine(load_model(tiny_dir))
    prompt = list(b"a call that moves between cells")
    a.add_request("r", prompt, SamplingParams(max_new_tokens=24, temperature=0))
    produced: list[int] = []
    while len(produced) < 8:
        for o in a.step():
            produced += o.token_ids
    kv = a.export_kv("r")
    handed = kv.length  # b extends this very cache
    assert a.abort("r").finish_reason == "abort"
    # Its KV left with it: A keeps only the prompt's copy, shared when it was prefilled.
    assert a.cache_stats()["entries"] == 1 and a.prefix_cache.covers(prompt)
    assert not a.prefix_cache.covers(prompt + produced[:1])
    b.add_request("r", prompt + produced, SamplingParams(max_new_tokens=24 - len(produced), temperature=0), kv=kv)
    rest, _, cached = run(b)["r"]
    assert cached == {handed}  # handed-over KV counts as cached
    follow = prompt + produced + rest + list(b" and then")
    ids, _, n = one(b, "next", follow)
    assert n == len(prompt) + len(produced) + len(rest) - 1
    assert ids == one(CpuEngine(tiny_model, prefix_cache_bytes=0), "x", follow)[0]


def test_a_client_abort_keeps_the_kv(tiny_model):
    engine = CpuEngine(tiny_model)
    prompt = list(b"abandoned midway")
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=50, temperature=0))
    produced: list[int] = []
    for _ in range(5):
        for o in engine.step():
            produced += o.token_ids
    assert engine.abort("r").cached_tokens == 0
    assert one(engine, "again", prompt + produced + [32])[2] == len(prompt) + len(produced) - 1


def test_release_memory_flushes_and_reports_the_bytes(tiny_model):
    engine = CpuEngine(tiny_model)
    one(engine, "a", list(b"before the role change"))
    held = engine.cache_stats()["bytes"]
    assert held > 0 and engine.kv_bytes == held
    assert engine.release_memory() == held
    assert engine.cache_stats()["entries"] == 0 and engine.kv_bytes == 0
    engine.resume_memory()
    assert one(engine, "b", list(b"before the role change, again"))[2] == 0


def test_new_weights_flush_the_cache_and_running_kv_is_not_kept(tiny_model):
    engine = CpuEngine(tiny_model)
    prompt = list(b"old weights")
    ids, _, _ = one(engine, "a", prompt)
    engine.add_request("running", list(b"across the update"), GREEDY)
    engine.step()
    engine.load_weights(tiny_model.hf_state_dict().items(), version=1)
    assert engine.cache_stats()["entries"] == 0
    run(engine)  # finishes with KV partly from the old weights: not cached
    assert engine.cache_stats()["entries"] == 0
    assert one(engine, "b", prompt + ids + [32])[2] == 0


def test_eviction_under_a_small_budget_keeps_within_it(tiny_model):
    probe = CpuEngine(tiny_model)
    one(probe, "p", list(b"x" * 20))
    budget = int(probe.cache_stats()["bytes"] * 2.5)
    engine = CpuEngine(tiny_model, prefix_cache_bytes=budget)
    for i in range(5):
        one(engine, f"r{i}", list(f"{i}".encode() * 20))
        assert engine.cache_stats()["bytes"] <= budget
    stats = engine.cache_stats()
    assert stats["entries"] == 2 and stats["evictions"] == 3


# --- PrefixCache itself ------------------------------------------------------------------

def fake_kv(tokens: list[int], capacity: int | None = None) -> SeqCache:
    """A one-layer SeqCache whose keys record the token at each position (to check copies)."""
    cap = capacity or max(1, len(tokens))
    k = torch.full((1, cap, 1), -1.0)
    k[0, : len(tokens), 0] = torch.tensor(tokens, dtype=torch.float32)
    return SeqCache(k=[k], v=[k.clone()], length=len(tokens))


def kv_tokens(cache: SeqCache) -> list[int]:
    return [int(x) for x in cache.k[0][0, : cache.length, 0]]


def test_lru_eviction_order_and_an_entry_over_budget():
    size = fake_kv([0] * 8).nbytes
    pc = PrefixCache(budget_bytes=3 * size)
    for i in range(3):
        assert pc.insert([i] * 8, fake_kv([i] * 8))
    assert pc.lookup([0] * 4 + [9]).length == 4  # a copy: entry 0 stays, now the most recent
    assert pc.insert([3] * 8, fake_kv([3] * 8))
    assert pc.lookup([1] * 8) is None  # entry 1, the least recently used, went first
    assert pc.lookup([0] * 9) is not None and pc.lookup([2] * 9) is not None
    assert pc.stats()["evictions"] == 1 and pc.bytes <= pc.budget_bytes
    assert not pc.insert([5] * 40, fake_kv([5] * 40))  # larger than the whole budget
    assert pc.stats()["entries"] == 1  # [3]*8; 0 and 2 moved out to their lookups


def test_bytes_count_capacity_and_flush_returns_them():
    pc = PrefixCache(budget_bytes=1 << 20)
    kv = fake_kv([1, 2, 3], capacity=64)
    pc.insert([1, 2, 3], kv)
    assert pc.bytes == kv.nbytes == 2 * 64 * 4
    assert pc.flush() == kv.nbytes and len(pc) == 0 and pc.bytes == 0


def test_a_copy_does_not_touch_the_entry_and_a_move_takes_it():
    pc = PrefixCache(budget_bytes=1 << 20)
    pc.insert([1, 2, 3, 4, 5], fake_kv([1, 2, 3, 4, 5]))
    part = pc.lookup([1, 2, 3, 9])
    assert kv_tokens(part) == [1, 2, 3]
    part.k[0][0, :5, 0] = 7.0  # the request writes its own positions
    whole = pc.lookup([1, 2, 3, 4, 5, 6])
    assert kv_tokens(whole) == [1, 2, 3, 4, 5] and len(pc) == 0  # moved: out until re-inserted
    pc.insert([1, 2, 3, 4, 5], whole)
    assert pc.lookup([1, 2]).length == 1  # at most all but the last prompt token
    assert pc.lookup([8]) is None
    s = pc.stats()
    assert (s["lookups"], s["hits"], s["tokens_reused"], s["tokens_looked_up"]) == (4, 3, 9, 13)


def test_an_extended_sequence_replaces_its_prefix_entry():
    pc = PrefixCache(budget_bytes=1 << 20)
    pc.insert([1, 2, 3], fake_kv([1, 2, 3]))
    pc.insert([1, 2, 3, 4, 5], fake_kv([1, 2, 3, 4, 5]))
    assert len(pc) == 1
    assert not pc.insert([1, 2], fake_kv([1, 2]))  # covered by the entry already
    assert len(pc) == 1 and pc.bytes == fake_kv([1, 2, 3, 4, 5]).nbytes


tokens = st.lists(st.integers(0, 3), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(entries=st.lists(tokens, max_size=12), prompt=tokens)
def test_lookup_matches_a_brute_force_longest_common_prefix(entries, prompt):
    pc = PrefixCache(budget_bytes=1 << 30)
    for e in entries:
        pc.insert(e, fake_kv(e))

    def brute(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    p = np.array(prompt, dtype=np.int32)
    assert all(lcp(np.array(e, dtype=np.int32), p) == brute(e, prompt) for e in entries)
    best = max((brute(e, prompt) for e in entries), default=0)
    got = pc.lookup(prompt)
    want = min(best, len(prompt) - 1)
    if want == 0:
        assert got is None
    else:
        assert got.length == want and kv_tokens(got) == prompt[:want]


def test_lookup_stays_fast_over_hundreds_of_long_entries():
    import time

    rng = np.random.default_rng(0)
    system = rng.integers(0, 50_000, 1000).tolist()
    pc = PrefixCache(budget_bytes=1 << 40)
    for _ in range(300):
        seq = system + rng.integers(0, 50_000, 3000).tolist()
        pc.insert(seq, SeqCache(k=[torch.zeros(1, 1, 1)], v=[torch.zeros(1, 1, 1)], length=len(seq)))
    prompt = system + rng.integers(0, 50_000, 3000).tolist()
    t0 = time.perf_counter()
    for _ in range(10):
        pc._longest(np.asarray(prompt, dtype=np.int32))
    assert (time.perf_counter() - t0) / 10 < 0.05  # ~1 ms measured; generous for loaded CI machines


# --- the worker streams it ----------------------------------------------------------------

def test_worker_chunks_carry_cached_tokens(tiny_model):
    from gyre.workerd import wire
    from gyre.workerd.config import WorkerConfig
    from gyre.workerd.worker import Role, Worker

    worker = Worker(WorkerConfig(coordinator="tcp://127.0.0.1:1", node_id="n0"))
    worker.engine, worker.role = CpuEngine(tiny_model), Role.ROLLOUT

    def call(req_id, prompt):
        worker.generate(wire.Generate(req_id=req_id, rid=f"r{req_id}", prompt_ids=prompt, max_new_tokens=6,
                                      temperature=0), [])
        chunks = []
        while worker.busy:
            chunks += [m for m, _ in worker.step()]
        return chunks

    prompt = list(b"worker turn one")
    first = call(1, prompt)
    assert {c.cached_tokens for c in first} == {0}
    ids = [t for c in first for t in c.token_ids]
    second = call(2, prompt + ids + [32])
    assert {c.cached_tokens for c in second} == {len(prompt) + len(ids) - 1}
    context = prompt + ids + [32] + [t for c in second for t in c.token_ids]
    worker.generate(wire.Generate(req_id=3, rid="r3", prompt_ids=context + [32], max_new_tokens=6), [])
    worker.step()
    aborted, _ = worker.abort(wire.Abort(req_id=4, rid="r3"), [])
    assert aborted[0].cached_tokens == len(context) - 1


@pytest.mark.parametrize("mb, expected", [(None, 512 << 20), (0, None), (3, 3 << 20)])
def test_prefix_cache_mb_engine_option(tiny_dir, mb, expected):
    from gyre.workerd import wire
    from gyre.workerd.backends import build_backends

    spec = wire.EngineSpec() if mb is None else wire.EngineSpec(prefix_cache_mb=mb)
    engine, _, _ = build_backends(str(tiny_dir), engine="cpu", trainer="cpu", engine_spec=spec,
                                  trainer_spec=wire.TrainerSpec())
    assert (None if engine.prefix_cache is None else engine.prefix_cache.budget_bytes) == expected


def test_requests_arriving_together_share_the_first_ones_prefill(tiny_model):
    """A group's executions of one task send the same prompt at once: the first prefills it,
    the others reuse its KV (shared at prefill, not only when it finishes); outputs equal an
    engine without the cache, and later arrivals sharing only the system prompt reuse that."""
    prompt = list(b"system: you are an agent with tools. user: fix the failing test")
    other = prompt[:30] + list(b" something else entirely")
    with_cache, without = CpuEngine(tiny_model), CpuEngine(tiny_model, prefix_cache_bytes=0)
    for engine in (with_cache, without):
        for i in range(4):
            engine.add_request(f"g{i}", prompt, SamplingParams(max_new_tokens=6, temperature=0))
        engine.add_request("o", other, SamplingParams(max_new_tokens=6, temperature=0))
    got, ref = run(with_cache), run(without)
    assert got["g0"][2] == {0} and all(got[f"g{i}"][2] == {len(prompt) - 1} for i in (1, 2, 3))
    assert got["o"][2] == {30}
    for rid in got:
        assert got[rid][0] == ref[rid][0]
        assert max(abs(x - y) for x, y in zip(got[rid][1], ref[rid][1])) < 1e-5

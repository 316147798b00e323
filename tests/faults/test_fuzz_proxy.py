"""The proxy fuzzer (bench/fuzz_proxy.py), small: a few hundred random and mutated inputs
per API against a live proxy, with the scripted engine behind it. Every answer must be a
served call, a provider-shaped 4xx or a 503 by design; nothing may be logged as an error;
the server must serve a valid call of each API afterwards."""

from __future__ import annotations

import pytest

from bench import fuzz_proxy  # the repository root is on the path (pyproject: pythonpath)


@pytest.mark.parametrize("seed", [0, 1])
async def test_random_and_mutated_requests_get_a_served_call_or_a_shaped_4xx(chat_tokenizer, tmp_path, seed):
    report = await fuzz_proxy.fuzz(chat_tokenizer, 300, seed=seed, run_dir=tmp_path)
    assert report.ok, "\n".join(report.failures[:10] + report.logged[:10] + list(report.crashes))
    for api in fuzz_proxy.APIS:
        counts = report.counts[api]
        assert sum(counts.values()) >= 300
        assert counts[200] > 30 and sum(n for s, n in counts.items() if 400 <= s < 500) > 100, counts
        assert not [s for s in counts if s >= 500 and s != 503], counts

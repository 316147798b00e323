"""The sandbox host pool's choice and the run config's [[sandbox_hosts]] checks (no engine
needed: the pool's hosts here are process backends, the choice never talks to them)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.sandbox.hosts import HostPool, SandboxHost, host_specs
from gyre.coordinator.sandbox.process import ProcessBackend


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.one_of(st.none(), st.integers(1, 5)), st.booleans()),
                min_size=1, max_size=6), st.sets(st.integers(0, 5)))
def test_choose_takes_the_least_loaded_free_up_host(spec, prefer_idx):
    hosts = [SandboxHost(f"h{i}", ProcessBackend(), cap, running=load, state="up" if up else "down")
             for i, (load, cap, up) in enumerate(spec)]
    pool = HostPool(hosts, ping_interval_s=0)
    prefer = {f"h{i}" for i in prefer_idx}
    got = pool.choose(prefer)
    free = [h for h in hosts if h.state == "up" and (h.max_concurrent is None or h.running < h.max_concurrent)]
    if not free:
        assert got is None
        return
    assert got in free
    preferred = [h for h in free if h.name in prefer]
    pick_from = preferred or free
    assert got in pick_from and got.running == min(h.running for h in pick_from)


def test_a_host_marked_down_is_skipped_and_comes_back():
    a, b = SandboxHost("a", ProcessBackend()), SandboxHost("b", ProcessBackend(), running=3)
    pool = HostPool([a, b], ping_interval_s=0)
    assert pool.choose() is a
    pool.mark_down(a, "no answer")
    assert pool.choose() is b and a.down.is_set() and pool.rows()[0]["why"] == "no answer"
    pool.mark_up(a)
    assert pool.choose() is a and not a.down.is_set()


@pytest.mark.parametrize("entry, words", [
    ({"url": "unix:///x"}, "sandbox_hosts[0].name"),
    ({"name": "a", "url": "/var/run/x.sock"}, "sandbox_hosts[0].url"),
    ({"name": "a", "url": "tcp://h:1", "max_concurrent": 0}, "max_concurrent must be an integer >= 1"),
    ({"name": "a", "url": "tcp://h:1", "cap": 3}, "unknown key(s) cap"),
    ({"name": "a", "url": "tcp://h:1", "node": ""}, "sandbox_hosts[0].node"),
])
def test_bad_host_entries_are_named(entry, words):
    with pytest.raises(ValueError) as e:
        host_specs([entry])
    assert words in str(e.value)


def test_duplicate_names_and_the_wrong_backend_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"sandbox_hosts\[1\].name 'a' is given twice"):
        host_specs([{"name": "a", "url": "tcp://h:1"}, {"name": "a", "url": "tcp://h:2"}])
    with pytest.raises(ValueError, match="set sandbox = \"podman\" or \"docker\""):
        CoordinatorConfig(run_dir=tmp_path, model_dir=tmp_path, sandbox="process", sandbox_hosts=({"name": "a", "url": "tcp://h:1"},))

"""Execution-affine routing (coordinator/routing.py), as properties over random histories:
calls go to their execution's home while it accepts and is within the load bound; no call
goes to an engine where the caller sits past the bound, nor to one not accepting; when an
engine closes, its executions are re-homed in the paper's destination order (standalone
engines first, then cells from the last down), each to the first one under the bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.coordinator.routing import RoutingTable, _rank

NODES = [f"n{i}" for i in range(4)]

op = st.one_of(
    st.tuples(st.just("call"), st.integers(0, 23)),
    st.tuples(st.just("forget"), st.integers(0, 23)),
    st.tuples(st.just("close"), st.integers(0, 3)),
    st.tuples(st.just("open"), st.integers(0, 3)),
)


def destination_order(table: RoutingTable):
    return sorted((r for r in table.routes.values() if r.accepting), key=lambda r: (not r.standalone, -r.order))


def consistent(table: RoutingTable) -> None:
    for ex, node in table.homes.items():
        assert ex in table.routes[node].homes
        assert table.routes[node].accepting  # a closed engine keeps no homes
    assert sum(len(r.homes) for r in table.routes.values()) == len(table.homes)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=80), standalone=st.sets(st.sampled_from(NODES), max_size=2),
       balance_abs=st.integers(1, 3), balance_rel=st.sampled_from([1.0, 1.25, 1.5, 2.0]))
def test_affine_routing_properties(ops, standalone, balance_abs, balance_rel):
    table = RoutingTable(balance_abs=balance_abs, balance_rel=balance_rel)
    table.set_nodes(NODES, standalone=frozenset(standalone))
    for kind, arg in ops:
        if kind == "call":
            ex = f"e{arg}"
            home = table.homes.get(ex)
            bound = table.bound()
            stays = (home is not None and table.routes[home].accepting
                     and _rank(table.routes[home].homes, ex) < bound)
            route = table.pick(ex)
            if bound is None:
                assert route is None
                continue
            assert route is not None and route.accepting
            if stays:  # its home accepts and it is within the bound: its call goes home
                assert route.node == home
            # Nobody is served where they sit past the bound (a new or shed execution goes to
            # the least loaded engine, where it is within the bound by construction).
            assert _rank(route.homes, ex) < bound
            assert table.homes[ex] == route.node
        elif kind == "forget":
            table.forget(f"e{arg}")
            assert f"e{arg}" not in table.homes
        elif kind == "close":
            node = NODES[arg]
            loads = {r.node: len(r.homes) for r in table.routes.values()}
            order = [r.node for r in destination_order(table) if r.node != node]
            was_open = table.routes[node].accepting
            moved = table.close(node)
            if not was_open:
                assert moved == []
            # Replay: each moved execution went to the first destination under the bound
            # (computed as loads stood at its move), else to a least-loaded one.
            for ex in moved:
                if not order:
                    assert ex not in table.homes  # nowhere to go: unhomed until its next call
                    continue
                dest = table.homes[ex]
                live = [loads[n] for n in order]
                bound = max(min(live) + balance_abs, int(min(live) * balance_rel))
                under = [n for n in order if loads[n] < bound]
                least = min(order, key=lambda n: (loads[n], table.routes[n].order))  # nothing in flight here
                assert dest == (under[0] if under else least)
                loads[dest] += 1
        else:
            table.open(NODES[arg])
        consistent(table)


def test_calls_of_one_execution_stay_home_and_new_ones_spread():
    table = RoutingTable()
    table.set_nodes(NODES[:3])
    first = {f"e{i}": table.pick(f"e{i}").node for i in range(6)}
    assert sorted(first.values()) == ["n0", "n0", "n1", "n1", "n2", "n2"]  # placed by load
    for _ in range(5):
        for ex, node in first.items():
            assert table.pick(ex).node == node
    assert table.decisions["placed"] == 6 and table.decisions["home"] == 30


def test_leaving_rollout_rehomes_standalone_first_then_cells_from_the_last_down():
    table = RoutingTable(balance_abs=1, balance_rel=1.0)
    table.set_nodes(["c0", "c1", "c2", "pool"], standalone=frozenset({"pool"}))
    for i in range(8):
        table.pick(f"e{i}")  # two each
    moved = table.close("c0")
    assert len(moved) == 2
    # Bound: min 2 + 1 = 3: the pool takes one (to 3), then c2 (the last cell) takes one.
    assert [table.homes[e] for e in moved] == ["pool", "c2"]
    table.open("c0")
    assert all(table.homes[e] != "c0" for e in moved)  # they stay at their new home
    # New executions fill the reopened engine by load.
    assert table.pick("new").node == "c0"


def test_an_overloaded_home_sheds_its_newest_executions():
    table = RoutingTable(balance_abs=1, balance_rel=1.0)
    table.set_nodes(["a", "b"])
    table.close("b")
    for i in range(4):
        table.pick(f"e{i}")  # all on a: b is closed
    table.open("b")  # loads a=4, b=0: bound 1
    assert table.pick("e0").node == "a"  # the oldest stays (rank 0 < bound 1)
    assert table.pick("e3").node == "b"  # the newest is shed to the least loaded
    assert table.decisions["shed"] == 1
    assert table.pick("e3").node == "b"  # and stays there


def test_least_inflight_is_the_baseline():
    table = RoutingTable(policy="least-inflight")
    table.set_nodes(["a", "b"])
    r = table.pick("e0")
    r.started(0.0)
    assert table.pick("e0").node != r.node  # no affinity: the idle engine
    assert table.homes == {}


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown routing"):
        RoutingTable(policy="random")
    with pytest.raises(ValueError, match="balance_abs"):
        RoutingTable(balance_abs=0)


# --- over real workerds: homes hold the KV, calls come back to it ---------------------------

TURN = "Tool result: the file holds a few lines of code that the agent reads before its next edit. "


async def agent(proxy, name: str, turns: int, start: int = 0, messages=None):
    """A multi-turn execution through the `openai` SDK: each call resends the history."""
    import openai

    ex = proxy.executions.get(name) or proxy.register(name)
    messages = messages if messages is not None else [
        {"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": f"Task {name}."}]
    async with openai.AsyncOpenAI(base_url=f"{proxy.base_url}/v1", api_key=ex.key, max_retries=0) as client:
        for t in range(start, start + turns):
            reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=12)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                         {"role": "user", "content": f"{TURN}({t})"}]
    return ex, messages


@pytest.mark.timeout(300)
async def test_affine_calls_hit_their_homes_cache_and_rehome_when_a_cell_leaves(tiny_dir, tmp_path):
    import asyncio

    from gyre.coordinator.local import LocalCluster
    from gyre.coordinator.routing import LinkBackend
    from gyre.proxy.chat import ChatTokenizer
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from gyre.workerd import wire
    from gyre.workerd.inproc import InprocWorkers

    async with LocalCluster(tiny_dir, cells=2, roles=("rollout", "rollout"), workers=InprocWorkers()) as cluster:
        nodes = [cluster.node_of_cell(0), cluster.node_of_cell(1)]
        table = RoutingTable()
        table.set_nodes(nodes)
        proxy = ProxyServer(ChatTokenizer(tiny_dir), LinkBackend(cluster.link, table),
                            ProxyConfig(temperature=0.0), run_dir=tmp_path)
        await proxy.start()
        try:
            names = [f"x{i}" for i in range(4)]
            done = await asyncio.gather(*(agent(proxy, n, turns=3) for n in names))
            for ex, _ in done:
                engines = {c["engine"] for c in ex.calls}
                assert len(engines) == 1  # every call of an execution went to its home
                assert ex.calls[0]["cached_tokens"] < ex.calls[0]["prompt_tokens"]
                for c in ex.calls[1:]:  # the history it resends is the home's cached KV
                    assert c["cached_tokens"] > 0
                    assert c["prefill_tokens"] <= c["new_prompt_tokens"] + 1
                    assert c["cached_tokens"] + c["prefill_tokens"] == c["prompt_tokens"]
            assert {next(iter({c["engine"] for c in ex.calls})) for ex, _ in done} == set(nodes)  # spread by load
            # Cell 0 leaves rollout: its executions are re-homed to cell 1 and stay there.
            moved = table.close(nodes[0])
            await cluster.link.call(nodes[0], wire.SetRole(role="training"))
            assert moved and all(table.homes[m] == nodes[1] for m in moved)
            again = await asyncio.gather(*(agent(proxy, ex.id, turns=2, start=3, messages=msgs)
                                           for ex, msgs in done if ex.id in moved))
            for ex, _ in again:
                first, second = ex.calls[3], ex.calls[4]
                assert first["engine"] == second["engine"] == nodes[1]
                assert second["cached_tokens"] > first["new_prompt_tokens"]  # the new home's cache now has it
        finally:
            await proxy.stop()
    assert table.decisions["rehomed"] == len(moved)


def test_the_run_config_names_a_bad_routing(tmp_path):
    from gyre.coordinator.config import CoordinatorConfig

    with pytest.raises(ValueError, match="routing must be one of affine, least-inflight"):
        CoordinatorConfig(run_dir=tmp_path, model_dir=tmp_path, routing="random")
    with pytest.raises(ValueError, match="route_balance_rel must be >= 1"):
        CoordinatorConfig(run_dir=tmp_path, model_dir=tmp_path, route_balance_rel=0.5)

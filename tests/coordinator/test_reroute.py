"""Harness-preserving role changes: requests in flight on a cell that leaves rollout are
handed back and continue on another cell (prompt + tokens so far). Every call completes,
each is recorded once, and greedy outputs equal an undisturbed run's."""

from __future__ import annotations

import asyncio

import openai
import pytest

from gyre.coordinator.local import LocalCluster
from gyre.coordinator.routing import LinkBackend, RoutingTable
from gyre.proxy.chat import ChatTokenizer
from gyre.proxy.server import ProxyConfig, ProxyServer
from gyre.workerd import wire
from gyre.workerd.inproc import InprocWorkers

PROMPTS = [f"Tell me story number {i}." for i in range(6)]


async def run_calls(proxy, name, flip=None):
    ex = proxy.register(name)
    started = asyncio.Event()
    async with openai.AsyncOpenAI(base_url=f"{proxy.base_url}/v1", api_key=ex.key, max_retries=0) as client:
        async def one(p):
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": p}], max_tokens=120, temperature=0, stream=True)
            text = ""
            async for chunk in stream:
                started.set()
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
            return text

        tasks = [asyncio.create_task(one(p)) for p in PROMPTS]
        if flip is not None:
            await started.wait()
            await flip()
        texts = await asyncio.gather(*tasks)
    outputs = {c["call_id"]: ex.tree.nodes[c["output_node"]].tokens.tolist() for c in ex.calls}
    return ex, texts, outputs


@pytest.mark.timeout(300)
async def test_role_changes_under_load_lose_nothing(tiny_dir, tmp_path):
    async with LocalCluster(tiny_dir, cells=2, roles=("rollout", "rollout"), workers=InprocWorkers()) as cluster:
        nodes = [cluster.node_of_cell(0), cluster.node_of_cell(1)]
        table = RoutingTable()
        table.set_nodes(nodes)
        backend = LinkBackend(cluster.link, table)
        # Greedy for every call (the run's sampling; a client's temperature is only recorded).
        proxy = ProxyServer(ChatTokenizer(tiny_dir), backend, ProxyConfig(ping_interval_s=0.2, temperature=0.0),
                            run_dir=tmp_path)
        await proxy.start()
        link = cluster.link

        async def set_role(node, role):
            if role == "training":
                table.close(node)  # stop new requests (executions re-homed), then hand back running ones
            await link.call(node, wire.SetRole(role=role))
            if role == "rollout":
                table.open(node)

        async def flip():
            for node in nodes * 2:  # each cell leaves and comes back, twice, under load
                await set_role(node, "training")
                await set_role(node, "rollout")

        try:
            ref, ref_texts, ref_out = await run_calls(proxy, "reference")
            assert backend.reroutes == 0
            ex, texts, out = await run_calls(proxy, "rerouted", flip=flip)
        finally:
            await proxy.stop()
        assert backend.reroutes > 0  # requests really were handed back and continued elsewhere
        assert backend.kv_handovers > 0  # ...with their KV prefix, not a recomputed prefill
        assert len(ex.calls) == len(PROMPTS) and all(c["status"] == "ok" for c in ex.calls)
        assert len({c["call_id"] for c in ex.calls}) == len(ex.calls)  # one record per call
        # Greedy decoding: the continued generation equals the undisturbed one, token for token.
        assert sorted(texts) == sorted(ref_texts)
        assert sorted(map(tuple, out.values())) == sorted(map(tuple, ref_out.values()))
        assert {len(c["versions"]) for c in ex.calls} == {1}

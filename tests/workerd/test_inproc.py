"""In-process workers (gyre/workerd/inproc.py): the same `WorkerServer` and `Worker` on a
thread, reached through the same `WorkerLink`, with what a process gives for free kept:
a failed start-up is named, a worker that is gone fails what is sent to it, and no
tensor crosses between the two sides by reference."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from gyre.coordinator.link import WorkerDeadError
from gyre.coordinator.local import ClusterStartError, LocalCluster
from gyre.workerd import wire
from gyre.workerd.inproc import InprocWorkers
from gyre.workerd.tensors import from_frames

PROMPT = [1, 2, 3, 4, 5]


def inproc_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("gyre-inproc")]


async def test_a_bad_model_dir_fails_start_up_with_the_workers_reason(tmp_path):
    cluster = LocalCluster(tmp_path / "no-model", cells=1, workers=InprocWorkers(), start_timeout_s=120)
    with pytest.raises(ClusterStartError, match="exited during start-up"):
        await cluster.__aenter__()
    assert any(isinstance(e, wire.WorkerDead) and "does not exist" in e.reason for e in cluster.events)


async def test_generate_then_shutdown_ends_every_thread(tiny_dir):
    async with LocalCluster(tiny_dir, cells=2, roles=("rollout", "training"), workers=InprocWorkers()) as cluster:
        node = cluster.node_of_cell(0)
        chunks = [c async for c in cluster.link.generate(node, wire.Generate(rid="a", prompt_ids=PROMPT,
                                                                               max_new_tokens=6))]
        assert chunks[-1].finished and sum(len(c.token_ids) for c in chunks) == 6
        assert len(inproc_threads()) == 4  # a worker and its heartbeats, per cell
        assert all(cluster.link.nodes[n].alive for n in cluster.nodes)
    assert all(p.returncode == 0 for p in cluster.procs)
    assert inproc_threads() == []


async def test_a_worker_that_is_gone_fails_what_is_sent_to_it(tiny_dir):
    async with LocalCluster(tiny_dir, cells=1, roles=("rollout",), workers=InprocWorkers()) as cluster:
        node = cluster.node_of_cell(0)
        await cluster.link.request(node, wire.Shutdown(), timeout=30)
        assert await asyncio.wait_for(cluster.procs[0].wait(), 30) == 0
        with pytest.raises(WorkerDeadError):  # Deregistered on its way out, or unreachable now
            await cluster.link.request(node, wire.Stats(), timeout=30)


async def test_exported_weights_are_copies_not_the_trainers_memory(tiny_dir):
    """Over ZeroMQ a tensor is copied onto the wire; in process it is copied too, so a step
    that updates the trainer after an export never changes weights already handed over."""
    async with LocalCluster(tiny_dir, cells=1, roles=("training",), workers=InprocWorkers()) as cluster:
        node = cluster.node_of_cell(0)
        _, frames = await cluster.link.call(node, wire.ExportWeights(), timeout=60)
        assert frames and all(isinstance(f.data, (bytes, memoryview)) for f in frames)
        exported = {k: v.clone() for k, v in from_frames(frames).items()}
        worker = cluster.procs[0].server.worker  # the trainer's own parameters, changed in place
        with torch.no_grad():
            for p in worker.trainer.model.parameters():
                p.add_(1.0)
        assert all(torch.equal(v, exported[k]) for k, v in from_frames(frames).items())


async def test_a_publication_of_unchanged_weights_loads_nothing_where_the_engine_holds_them(tiny_dir):
    """A step that trained nothing publishes `unchanged`: an engine that holds the version loads
    nothing; one that does not (here: a version it never had; on a GPU, weights dropped on
    release) copies its own trainer, as a publication with no frames does."""
    async with LocalCluster(tiny_dir, cells=1, roles=("rollout",), workers=InprocWorkers()) as cluster:
        node = cluster.node_of_cell(0)
        same = await cluster.link.request(node, wire.LoadWeights(version=0, unchanged=True), timeout=60)
        assert (same.version, same.nbytes) == (0, 0)
        other = await cluster.link.request(node, wire.LoadWeights(version=3, unchanged=True), timeout=60)
        assert other.version == 3 and other.nbytes > 0
        again = await cluster.link.request(node, wire.LoadWeights(version=3, unchanged=True), timeout=60)
        assert again.nbytes == 0

"""A real `gyre workerd` process driven over real ZeroMQ by the coordinator's link:
streamed generation, abort, role changes both ways, a training step, weight export and
load, checkpoints and stats, the RPC error paths, and start-up and shutdown failures."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest
import torch

from gyre.coordinator.link import WorkerError, _Pending
from gyre.coordinator.local import ClusterStartError, LocalCluster
from gyre.workerd import wire
from tests.workerd.helpers import build_micro_step

pytestmark = pytest.mark.timeout(180)
PROMPT = list(b"<|im_start|>user\nhi")


async def collect(link, node, **kw):
    msg = wire.Generate(**kw)
    chunks = [c async for c in link.generate(node, msg)]
    return chunks, [t for c in chunks for t in c.token_ids], [lp for c in chunks for lp in c.logprobs]


async def test_workerd_serves_and_trains_over_zeromq(tiny_dir, tmp_path):
    async with LocalCluster(tiny_dir, cells=2, trainer={"lr": 1e-3}) as cluster:
        link = cluster.link
        rollout, train = cluster.node_of_cell(0), cluster.node_of_cell(1)
        assert {type(e) for e in cluster.events} >= {wire.Register, wire.Ready}

        # 1) Streamed generation: one chunk per token as the engine produces them.
        chunks, ids, lps = await collect(link, rollout, rid="a", prompt_ids=PROMPT, max_new_tokens=16, seed=1)
        assert len(chunks) == 16 and len(ids) == 16 and len(lps) == 16
        assert chunks[-1].finished and chunks[-1].finish_reason == "length"
        assert not any(c.finished for c in chunks[:-1]) and chunks[0].prompt_tokens == len(PROMPT)

        # 2) The training cell refuses rollout work (an Error reply, the daemon lives on).
        with pytest.raises(WorkerError, match="RoleError"):
            await collect(link, train, rid="b", prompt_ids=PROMPT, max_new_tokens=4)

        # 3) Abort by request id ends the stream with finish_reason "abort".
        gen = link.generate(rollout, wire.Generate(rid="long", prompt_ids=PROMPT,
                                                   max_new_tokens=5000))
        first = await anext(gen)
        assert not first.finished
        reply = await link.request(rollout, wire.Abort(rid="long"))
        assert reply == wire.Aborted(req_id=reply.req_id, found=True)
        rest = [c async for c in gen]
        assert rest[-1].finish_reason == "abort" and sum(len(c.token_ids) for c in rest) < 5000

        # 4) A training micro-step and an optimizer step on the training cell.
        frames = _frames(PROMPT, ids, lps)
        res, _ = await link.call(train, wire.TrainMicroStep(step=0), frames)
        assert isinstance(res, wire.TrainResult) and res.tokens == 16 and res.executions == 1
        assert abs(res.mismatch_kl) < 1e-4  # same initial weights in both cells
        upd, _ = await link.call(train, wire.OptimizerStep(num_executions=1))
        assert upd.version == 1 and upd.grad_norm > 0

        # 5) Export from the trainer, load into the engine: chunks now carry version 1.
        w, wframes = await link.call(train, wire.ExportWeights())
        assert w.version == 1 and w.nbytes == sum(memoryview(f.data).nbytes for f in wframes)
        loaded, _ = await link.call(rollout, wire.LoadWeights(version=1), wframes)
        assert loaded.version == 1 and loaded.nbytes == w.nbytes
        chunks, ids, lps = await collect(link, rollout, rid="c", prompt_ids=PROMPT, max_new_tokens=24, seed=2)
        assert {c.version for c in chunks} == {1}

        # 6) Mismatch check across processes: engine behaviour log-probs == trainer log-probs.
        reply, _ = await link.call(train, wire.Call(method="logprobs",
                                                    args={"input_ids": [PROMPT + ids]}))
        trainer_lps = torch.tensor(reply.result[0][len(PROMPT):])
        assert torch.allclose(torch.tensor(lps), trainer_lps, atol=1e-4)

        # 7) Role change while a request runs: its stream ends (abort), the cell trains, then
        #    comes back to rollout and serves again. Nothing is restarted.
        gen = link.generate(rollout, wire.Generate(rid="d", prompt_ids=PROMPT,
                                                   max_new_tokens=5000))
        await anext(gen)
        changed, _ = await link.call(rollout, wire.SetRole(role="training"))
        assert changed.role == "training"
        assert [c async for c in gen][-1].finish_reason == "abort"
        with pytest.raises(WorkerError, match="RoleError"):
            await collect(link, rollout, rid="e", prompt_ids=PROMPT, max_new_tokens=2)
        res, _ = await link.call(rollout, wire.TrainMicroStep(step=1), frames)
        assert res.tokens == 16
        back, _ = await link.call(rollout, wire.SetRole(role="rollout"))
        assert back.role == "rollout"
        _, ids2, _ = await collect(link, rollout, rid="f", prompt_ids=PROMPT, max_new_tokens=3)
        assert len(ids2) == 3
        stats = await link.request(rollout, wire.Stats())
        assert isinstance(stats, wire.WorkerStats) and stats.node_id == rollout and stats.cell == 0
        assert stats.version == 1 and stats.role == "rollout" and stats.peak_rss_bytes > 0

        # 8) Typed control commands: a checkpoint saved and loaded back; a failing one names
        #    the command and the cell, with the worker-side exception's class.
        ckpt = str(tmp_path / "ckpt" / "trainer.pt")
        done = await link.request(train, wire.SaveCheckpoint(path=ckpt), timeout=60)
        assert isinstance(done, wire.Done)
        loaded = await link.request(train, wire.LoadCheckpoint(path=ckpt), timeout=60)
        assert loaded == wire.CheckpointLoaded(req_id=loaded.req_id, version=1)
        with pytest.raises(WorkerError) as e:
            await link.request(train, wire.LoadCheckpoint(path=str(tmp_path / "none.pt")))
        assert str(e.value).startswith(f"LoadCheckpoint on {cluster.describe(train)} failed: FileNotFoundError: ")
        assert e.value.kind == "FileNotFoundError"
        with pytest.raises(WorkerError, match=r"^SetParticipants on .* failed: RuntimeError: no reducer"):
            await link.request(train, wire.SetParticipants(participants=1))

        # 9) The diagnostic RPC path and its errors: echo, a failing call, an unknown method
        #    (the typed commands are not methods), a reply type that is not a command, an
        #    unknown kind. Each gets an answer; none kills it.
        echo, _ = await link.call(rollout, wire.Call(method="echo", args={"x": [1, 2]}))
        assert echo.result == {"x": [1, 2]}
        with pytest.raises(WorkerError, match="RuntimeError: boom"):
            await link.call(rollout, wire.Call(method="fail", args={"message": "boom"}))
        with pytest.raises(WorkerError, match="unknown method"):
            await link.call(rollout, wire.Call(method="nope"))
        with pytest.raises(WorkerError, match="unknown method 'stats'"):
            await link.call(rollout, wire.Call(method="stats"))
        with pytest.raises(WorkerError, match="not a workerd command"):
            await link.call(rollout, wire.StepResult(req_id=0, version=0, grad_norm=0, seconds=0))
        fut = asyncio.get_running_loop().create_future()
        link._pending[99999] = _Pending(rollout, future=fut)
        await link._sock.send_multipart([rollout.encode(), b"Bogus", b'{"req_id": 99999}'])
        err, _ = await asyncio.wait_for(fut, 30)
        assert isinstance(err, wire.Error) and err.req_id == 99999 and "unknown message kind" in err.message
        _, ids3, _ = await collect(link, rollout, rid="g", prompt_ids=PROMPT, max_new_tokens=2)
        assert len(ids3) == 2

        # 10) Heartbeats arrive while idle.
        assert cluster.heartbeats >= 1


def _frames(prompt, ids, lps):
    from gyre.workerd.tensors import to_frames

    return to_frames(build_micro_step(prompt, [(ids, lps)], [1.0]))


async def test_bad_model_dir_fails_start_up_fast(tmp_path):
    """The Welcome names a model that is not there: the daemon reports and exits, and the
    coordinator's start-up fails with a clear error instead of waiting out its deadline."""
    cluster = LocalCluster(tmp_path / "no-model", cells=1, start_timeout_s=120)
    with pytest.raises(ClusterStartError, match="exited during start-up"):
        await cluster.__aenter__()
    assert any(isinstance(e, wire.WorkerDead) and "does not exist" in e.reason for e in cluster.events)


async def test_workerd_without_coordinator_answer_exits_nonzero(tmp_path):
    """A handshake with a deadline: no Welcome -> exit 1 within the deadline."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gyre.cli", "workerd", "--coordinator", f"ipc://{tmp_path}/nobody",
        "--welcome-timeout", "1", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1 and b"HandshakeTimeout" in err


async def test_sigterm_hands_back_requests_and_deregisters(tiny_dir):
    async with LocalCluster(tiny_dir, cells=1, roles=("rollout",)) as cluster:
        link, node = cluster.link, cluster.node_of_cell(0)
        gen = link.generate(node, wire.Generate(rid="x", prompt_ids=PROMPT,
                                                max_new_tokens=100000))
        await anext(gen)
        cluster.procs[0].send_signal(signal.SIGTERM)
        rest = [c async for c in gen]
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        assert await asyncio.wait_for(cluster.procs[0].wait(), 30) == 0
        assert any(isinstance(e, wire.Deregister) for e in cluster.events)
        assert not link.nodes[node].alive


async def test_killed_worker_fails_pending_requests(tiny_dir):
    """SIGKILL gives no goodbye: the link marks the silent node dead and fails its stream."""
    async with LocalCluster(tiny_dir, cells=1, roles=("rollout",), heartbeat_s=0.2) as cluster:
        link, node = cluster.link, cluster.node_of_cell(0)
        gen = link.generate(node, wire.Generate(rid="x", prompt_ids=PROMPT,
                                                max_new_tokens=100000))
        await anext(gen)
        os.kill(cluster.procs[0].pid, signal.SIGKILL)
        await cluster.procs[0].wait()
        while not link.silent_nodes(timeout_s=1.0):
            await asyncio.sleep(0.1)  # polling a clock-driven condition, not synchronising on a sleep
        link.mark_dead(node, "missed heartbeats")
        from gyre.coordinator.link import WorkerDeadError

        with pytest.raises(WorkerDeadError, match="missed heartbeats"):
            async for _ in gen:
                pass


@pytest.mark.parametrize("engine, trainer, needle", [
    ("vllm", "cpu", "unknown engine backend 'vllm' (known: cpu, sglang)"),
    ("cpu", "deepspeed", "unknown trainer backend 'deepspeed' (known: cpu, megatron)"),
])
def test_backend_selection_errors_name_what_is_wrong(engine, trainer, needle):
    from gyre.workerd.backends import BackendError, check_backends

    with pytest.raises(BackendError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        check_backends(engine, trainer)


def test_a_missing_gpu_backend_names_its_package():
    import importlib.util

    from gyre.workerd.backends import BackendError, check_backends

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    with pytest.raises(BackendError) as e:
        check_backends("sglang", "cpu")
    assert "needs sglang>=0.5.23: pip install 'gyre[gpu]'" in str(e.value)
    from typer.testing import CliRunner

    from gyre.cli.main import app

    r = CliRunner().invoke(app, ["workerd", "--coordinator", "tcp://127.0.0.1:1", "--engine-backend", "sglang"])
    assert r.exit_code == 1 and "[error] engine backend 'sglang' needs sglang" in r.output


async def test_a_slow_start_up_is_not_silence(tiny_dir):
    """Building backends can outlast a worker timeout (megatron-core alone imports for seconds
    here; SGLang starts for tens of seconds on a GPU): heartbeats flow from the Welcome on,
    so a starting worker is never silent to the health watch."""
    pytest.importorskip("megatron.core")
    cluster = LocalCluster(tiny_dir, cells=1, roles=("rollout",), backends=("cpu", "megatron"), heartbeat_s=0.2)
    silent: list[str] = []
    done = asyncio.Event()

    async def watch():  # what the coordinator's health watch would see, at its own cadence
        while not done.is_set():
            silent.extend(cluster.link.silent_nodes(1.0))
            try:
                await asyncio.wait_for(done.wait(), 0.1)
            except TimeoutError:
                pass

    watcher = asyncio.create_task(watch())
    async with cluster:
        ready = next(e for e in cluster.events if isinstance(e, wire.Ready))
        done.set()
        await watcher
        assert ready.load_seconds > 1.0  # the build did outlast the timeout below
        assert silent == []

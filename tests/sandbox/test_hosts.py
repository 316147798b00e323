"""Several sandbox hosts: executions spread over them under each one's cap, and a host that
stops answering is marked down, its execution ended aborted_infra and the next one sent
elsewhere; it comes back when it answers again. Each host here is its own podman service."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from gyre.coordinator.buffer import Execution
from gyre.coordinator.launcher import Launcher, LaunchSpec, open_sandboxes
from gyre.coordinator.sandbox import Limits
from gyre.coordinator.sandbox.podman import podman_env
from gyre.coordinator.taskformats import load_harbor_task
from gyre.coordinator.waterlevel import Tracked
from tests.coordinator.test_netns import hosts  # noqa: F401  (the fixture)
from tests.sandbox.conftest import CALL_PROXY, harbor_task, shell_preset

# A host stopped mid-call (SIGSTOP) or gone refuses docker-py's connects; its unix transport
# leaves the refused socket in a frame's locals (docker/transport/unixconn.py `connect`), which
# urllib3 keeps in its retry errors: it closes at some later garbage collection, and under
# `-W error` that collection raises its ResourceWarning in whatever code runs then.
pytestmark = pytest.mark.filterwarnings("ignore:unclosed <socket.socket:ResourceWarning")


class Service:
    """`podman system service` on a socket of its own: one sandbox host."""

    def __init__(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="gyre-host-")
        self.sock = Path(self.tmp.name) / "podman.sock"
        self.url = f"unix://{self.sock}"
        self.proc = subprocess.Popen(["podman", "system", "service", "--time=0", self.url], env=podman_env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                     cwd=self.tmp.name)

    async def ready(self) -> None:
        for _ in range(400):
            if self.sock.exists():
                return
            assert self.proc.poll() is None, "podman system service exited"
            await asyncio.sleep(0.05)
        raise AssertionError("podman system service did not listen")

    def close(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.tmp.cleanup()


@pytest.fixture
async def services(podman_ready):
    made = [Service(), Service()]
    try:
        await asyncio.gather(*(s.ready() for s in made))
        yield made
    finally:
        for s in made:
            s.close()


def _launcher(proxy, run_dir, sandboxes, script: str) -> Launcher:
    spec = LaunchSpec(preset=shell_preset(script), timeout_s=120, eval_attempts=1, eval_budget_s=60,
                      limits=Limits(pids=256))
    return Launcher(proxy, run_dir, spec, pool=sandboxes.pool, owner=sandboxes.owner)


def _run(i: int, task) -> Execution:
    return Execution(id=f"e{i}", group=0, index=i, task=task, tracked=Tracked(), version_dispatched=0)


def _host(run_dir: Path, run: Execution) -> str:
    return json.loads((run_dir / "executions" / run.id / "sandbox.json").read_text())["host"]


async def _until(cond, what: str, timeout_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.05)


async def test_executions_spread_over_hosts_under_their_caps(services, scripted_proxy, tmp_path):
    a, b = services
    run_dir = tmp_path / "run"
    sandboxes = await open_sandboxes(sandbox="podman", run_dir=run_dir, hosts=[
        {"name": "a", "url": a.url, "max_concurrent": 1}, {"name": "b", "url": b.url, "max_concurrent": 1}])
    task = load_harbor_task(harbor_task(tmp_path, "spread"))
    try:
        launcher = _launcher(scripted_proxy, run_dir, sandboxes, CALL_PROXY + "sleep 1")
        assert launcher.images.state(task) == "building"  # built on one host before any slot is taken
        await launcher.images.prepare(task, sandboxes.pool.hosts[0])
        runs = [_run(i, task) for i in range(2)]
        jobs = [asyncio.create_task(launcher.run(r)) for r in runs]
        await _until(lambda: all(h.running == 1 for h in sandboxes.pool.hosts), "both hosts busy")
        assert launcher.images.state(task) == "building"  # every host at its cap: the next one waits
        await asyncio.gather(*jobs)
        assert [r.status for r in runs] == ["completed", "completed"], [r.ref for r in runs]
        assert sorted(_host(run_dir, r) for r in runs) == ["a", "b"]
        assert [h["running"] for h in sandboxes.pool.rows()] == [0, 0]
    finally:
        await sandboxes.close()


async def test_a_host_that_stops_answering_is_marked_down(services, scripted_proxy, tmp_path):
    a, b = services
    run_dir = tmp_path / "run"
    sandboxes = await open_sandboxes(sandbox="podman", run_dir=run_dir, hosts=[
        {"name": "b", "url": b.url}, {"name": "a", "url": a.url}], ping_interval_s=0.3, ping_timeout_s=1.0)
    task = load_harbor_task(harbor_task(tmp_path, "hang"))
    pool = sandboxes.pool
    try:
        launcher = _launcher(scripted_proxy, run_dir, sandboxes, CALL_PROXY + "sleep 600")
        first = _run(1, task)
        job = asyncio.create_task(launcher.run(first))
        await _until(lambda: "e1" in scripted_proxy.executions and scripted_proxy.executions["e1"].calls,
                     "the harness on b called the proxy")
        assert _host(run_dir, first) == "b"
        os.kill(b.proc.pid, signal.SIGSTOP)  # b's engine stops answering (it does not refuse: it hangs)
        await asyncio.wait_for(job, 60)
        assert first.status == "aborted_infra" and first.reward is None and not first.valid
        assert "sandbox host b stopped answering" in first.ref, first.ref
        (row_b, row_a) = pool.rows()
        assert row_b["state"] == "down" and row_b["failed"] == 1 and row_a["state"] == "up"
        # The next execution goes to a and completes there.
        launcher.spec = LaunchSpec(preset=shell_preset(CALL_PROXY), timeout_s=120, eval_attempts=1,
                                   eval_budget_s=60, limits=Limits(pids=256))
        second = _run(2, task)
        await launcher.run(second)
        assert second.status == "completed" and _host(run_dir, second) == "a", second.ref
        os.kill(b.proc.pid, signal.SIGCONT)
        await _until(lambda: pool.hosts[0].state == "up", "b answers again")
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
        await sandboxes.close()  # b is up again: its leftover container is reaped there


@pytest.mark.timeout(300)
async def test_a_host_in_another_network_namespace_gets_its_proxy_network_from_its_workerd(
        podman_ready, hosts, tiny_dir, tmp_path):
    """The sandbox host is another machine as far as the network can tell: its podman service
    and its workerd run in their own namespace on a bridge. The coordinator cannot setns there
    (it could here, but is not asked to): the workerd makes the container's proxy listener and
    relays to the coordinator's proxy over the bridge."""
    import secrets
    import sys

    from gyre.coordinator.config import CoordinatorConfig
    from gyre.coordinator.main import Coordinator
    from tests.coordinator.test_netns import SUBNET

    ns, ifname, addr = hosts[0]
    engine_port = 29000 + secrets.randbelow(900)
    # nsenter, not `ip netns exec`: that one also remounts /sys, hiding the cgroup mounts runc needs.
    engine = subprocess.Popen(["nsenter", f"--net=/var/run/netns/{ns}", "podman", "system", "service", "--time=0",
                               f"tcp://{addr}:{engine_port}"], env=podman_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True, cwd=tmp_path)
    address = f"tcp://{SUBNET}.1:{29000 + secrets.randbelow(900)}"
    folder = harbor_task(tmp_path / "tasks", "remote", test_sh=(
        '[ -s /app/answer.txt ] && echo 0.5 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n'))
    cfg = CoordinatorConfig(run_dir=tmp_path / "run", model_dir=tiny_dir, cells=1, steps=1, policy="colocate",
                            groups_per_step=1, group_size=1, min_valid=1, workers="external", address=address,
                            reducer_init=f"tcp://{addr}:{29900 + secrets.randbelow(90)}", topology_timeout_s=120,
                            tasks_path=folder, sandbox="podman", proxy_host=f"{SUBNET}.1",
                            sandbox_hosts=({"name": "far", "url": f"tcp://{addr}:{engine_port}", "node": "ns-0"},),
                            allow_unauthenticated_link=True)  # a private bridge of this test's own
    worker = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", ns, sys.executable, "-m", "gyre.cli", "workerd", "--coordinator", address,
        "--cell", "0", "--node-id", "ns-0", "--heartbeat", "0.5", env=dict(os.environ, GLOO_SOCKET_IFNAME=ifname),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        reports = await Coordinator(cfg).run()
    finally:
        _, err = await asyncio.wait_for(worker.communicate(), 60)
        engine.terminate()
        engine.wait(30)
    assert len(reports) == 1, err.decode()[-2000:]
    events = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (done,) = [e for e in events if e["event"] == "execution"]
    assert done["status"] == "completed" and done["reward"] == 0.5, (done, err.decode()[-2000:])
    ex = tmp_path / "run" / "executions" / done["id"]
    assert json.loads((ex / "sandbox.json").read_text())["host"] == "far"
    calls = (ex / "calls.jsonl").read_text().splitlines()
    assert calls and all(json.loads(c)["status"] == "ok" for c in calls)  # through the node's relay

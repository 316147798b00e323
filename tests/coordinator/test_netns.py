"""Workers on separate hosts, as far as the network can tell: each workerd runs in its own
network namespace, joined to the coordinator by veth pairs on a bridge. They register over
the bridge, the gradient reducer meets on a TCP store in cell 0's namespace, and a step
trains on both cells. The link crosses a real network, so it is CURVE-keyed (`gyre keys init`),
as a user's multi-host run must be. Skips, saying why, where namespaces cannot be created."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.main import Coordinator
from gyre.workerd.keys import init_keys
from tests.coordinator.scripted import write_tasks

HERE = Path(__file__).parent
SUBNET = "10.231.77"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def hosts():
    """Two namespaces on a bridge: the coordinator at .1, workers at .2 and .3."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need iproute2 and root")
    tag = secrets.token_hex(2)
    bridge, names = f"gyrebr{tag}", [f"gyre-w{i}-{tag}" for i in range(2)]
    try:
        _setup(bridge, names, tag)
    except (subprocess.CalledProcessError, OSError) as e:
        _teardown(bridge, names)
        pytest.skip(f"cannot build the test network here: {getattr(e, 'stderr', None) or e}")
    try:
        yield [(ns, f"gyren{i}{tag}", f"{SUBNET}.{i + 2}") for i, ns in enumerate(names)]
    finally:
        _teardown(bridge, names)


def _setup(bridge: str, names: list[str], tag: str) -> None:
    _ip("link", "add", bridge, "type", "bridge")
    _ip("addr", "add", f"{SUBNET}.1/24", "dev", bridge)
    _ip("link", "set", bridge, "up")
    for i, ns in enumerate(names):
        host_end, ns_end = f"gyreh{i}{tag}", f"gyren{i}{tag}"
        _ip("netns", "add", ns)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        _ip("link", "set", ns_end, "netns", ns)
        _ip("link", "set", host_end, "master", bridge)
        _ip("link", "set", host_end, "up")
        _ip("addr", "add", f"{SUBNET}.{i + 2}/24", "dev", ns_end, ns=ns)
        _ip("link", "set", ns_end, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)


def _teardown(bridge: str, names: list[str]) -> None:
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", bridge], capture_output=True)


@pytest.mark.timeout(300)
async def test_workers_in_separate_network_namespaces(tiny_dir, tmp_path, hosts):
    tasks = write_tasks(tmp_path / "tasks.jsonl", 3)
    address = f"tcp://{SUBNET}.1:{29000 + secrets.randbelow(900)}"
    keys = tmp_path / "keys"
    init_keys(keys, workers=("w0", "w1"))
    cfg = CoordinatorConfig(run_dir=tmp_path / "run", model_dir=tiny_dir, cells=2, steps=1, policy="colocate",
                            groups_per_step=1, group_size=2, min_valid=1, workers="external", address=address,
                            keys_dir=keys,
                            reducer_init=f"tcp://{hosts[0][2]}:{29900 + secrets.randbelow(90)}",
                            topology_timeout_s=120, harness=(sys.executable, str(HERE / "_harness.py")),
                            tasks_path=tasks, default_max_tokens=8)
    procs = []
    for cell, (ns, ifname, _) in enumerate(hosts):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=ifname)  # gloo's peers talk over the veth
        procs.append(await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", ns, sys.executable, "-m", "gyre.cli", "workerd", "--coordinator", address,
            "--cell", str(cell), "--node-id", f"ns-{cell}", "--heartbeat", "0.5",
            "--keys", str(keys), "--key-name", f"w{cell}", env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE))
    try:
        coord = Coordinator(cfg)
        reports = await coord.run()
    finally:
        outs = [await asyncio.wait_for(p.communicate(), 60) for p in procs]
    assert len(reports) == 1 and reports[0].cells_training == 2  # the reducer spanned both namespaces
    assert [p.returncode for p in procs] == [0, 0], [o[1].decode()[-1500:] for o in outs]
    registered = {n.registered.node_id for n in coord.cluster.nodes.values()}
    assert registered == {"ns-0", "ns-1"}

"""CURVE on the coordinator <-> workerd link: `gyre keys`, authorised workers register and
serve, a worker with a wrong key (or none) cannot even register."""

from __future__ import annotations

import asyncio
import stat
import sys

import pytest
from typer.testing import CliRunner

from gyre.cli.main import app
from gyre.coordinator.link import WorkerLink
from gyre.coordinator.local import LocalCluster
from gyre.workerd import wire
from gyre.workerd.keys import KeyFileError, add_worker, client_keys, init_keys, server_keys
from tests.workerd.test_workerd_process import PROMPT, collect


def test_keys_init_layout_and_modes(tmp_path):
    root = tmp_path / "keys"
    r = CliRunner().invoke(app, ["keys", "init", str(root), "--worker", "n1", "--worker", "n2"])
    assert r.exit_code == 0, r.output
    assert {p.name for p in (root / "authorized").iterdir()} == {"n1.key", "n2.key"}
    for secret in [root / "coordinator.key_secret", *(root / "workers").glob("*.key_secret")]:
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pub, sec, authorized = server_keys(root)
    assert len(pub) == len(sec) == 40 and authorized == root / "authorized"
    wpub, wsec, server = client_keys(root, "n1")
    assert server == pub and wpub != pub
    r = CliRunner().invoke(app, ["keys", "init", str(root)])
    assert r.exit_code == 1 and "already holds a coordinator key" in r.output
    with pytest.raises(KeyFileError, match="already exists"):
        add_worker(root, "n1")
    with pytest.raises(KeyFileError, match="missing key file"):
        client_keys(root, "ghost")
    with pytest.raises(KeyFileError, match="not a key directory"):
        add_worker(tmp_path / "elsewhere", "x")


@pytest.mark.timeout(120)
async def test_authorised_workers_register_and_serve(tiny_dir, tmp_path):
    keys = tmp_path / "keys"
    init_keys(keys, workers=("w",))
    async with LocalCluster(tiny_dir, cells=1, roles=("rollout",), keys_dir=keys, key_name="w") as cluster:
        assert any(isinstance(e, wire.Ready) for e in cluster.events)
        chunks, ids, _ = await collect(cluster.link, cluster.node_of_cell(0), rid="a", prompt_ids=PROMPT,
                                       max_new_tokens=4, seed=1)
        assert len(ids) == 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("worker_keys", ["foreign", "none"])
async def test_a_worker_without_an_authorised_key_cannot_register(tmp_path, worker_keys):
    keys, foreign = tmp_path / "keys", tmp_path / "foreign"
    init_keys(keys)
    init_keys(foreign)  # a valid pair, but not in the coordinator's authorized/
    seen: list = []
    link = WorkerLink("tcp://127.0.0.1:0", on_event=seen.append, keys_dir=keys)
    address = await link.start()
    reader = asyncio.create_task(link.serve())
    try:
        args = ["--keys", str(foreign)] if worker_keys == "foreign" else []
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gyre.cli", "workerd", "--coordinator", address, "--welcome-timeout", "3", *args,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 1
        assert "no Welcome" in err.decode()
        assert not seen and not link.nodes  # not a single message got through
    finally:
        reader.cancel()
        link.close()

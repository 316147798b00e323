"""The weight-transfer layer: packing, the Mooncake backend between real workerds, and a
real run that publishes and joins through it. Mooncake listens on every interface, so
everything that starts it runs in a private network namespace (`unshare -n`); those tests
skip, saying why, where Mooncake or namespaces are unavailable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre.workerd.transfer import MooncakeTransfer, TransferError, pack, unpack

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def test_pack_unpack_round_trip():
    named = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(4),
             "d": torch.tensor(2.5), "e": torch.randn(2, 3).to(torch.float16)}
    p = pack(named)
    assert p.buffer.dtype == torch.uint8 and all(off % 64 == 0 for *_, off, _ in p.manifest)
    out = unpack(p.buffer, json.loads(json.dumps(p.manifest)))  # the manifest travels as JSON
    assert list(out) == list(named)
    for k in named:
        assert out[k].dtype == named[k].dtype and torch.equal(out[k], named[k])


def test_unsupported_dtypes_are_named():
    with pytest.raises(TransferError, match="tensor 'z'.*complex64"):
        pack({"z": torch.zeros(2, dtype=torch.complex64)})


def test_missing_mooncake_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(TransferError, match="pip install mooncake-transfer-engine-non-cuda"):
        MooncakeTransfer("127.0.0.1")


def _mooncake_or_skip() -> None:
    r = subprocess.run([sys.executable, "-c", "from mooncake.engine import TransferEngine"], capture_output=True,
                       text=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"Mooncake does not import here: {r.stderr.strip().splitlines()[-1] if r.stderr else r}")
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("a private network namespace needs unshare and root")
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -n is not permitted here")


def _in_private_netns(command: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(["unshare", "-n", "sh", "-c", f"ip link set lo up && {command}"], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(300)
def test_mooncake_pull_between_workerds(tiny_dir):
    _mooncake_or_skip()
    r = _in_private_netns(f"{sys.executable} {HERE / '_mooncake_check.py'} {tiny_dir}", 240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["equal"] and out["version"] == 5 and out["tensors"] > 50
    assert out["nbytes"] >= 6_000_000  # the whole 1.5 M-parameter model in fp32
    assert out["session"].startswith("127.0.0.1:")


def _up_in_private_netns(run: Path, *sets: str) -> list[dict]:
    """`gyre up --steps 2 --policy elastic` with `--set`s, in its own namespace; its events."""
    flags = " ".join(f"--set {x}" for x in sets)
    r = _in_private_netns(f"{sys.executable} -m gyre.cli up --steps 2 --policy elastic --run-dir {run} --no-live "
                          f"{flags}", 360)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(400)
def test_a_run_publishes_and_joins_through_mooncake(tmp_path):
    _mooncake_or_skip()
    events = _up_in_private_netns(tmp_path / "run", "weight_transfer=mooncake")
    publishes = [e for e in events if e["event"] == "publish"]
    assert publishes and all(e["transfer"] == "mooncake" and e["bytes"] > 6_000_000 for e in publishes)
    assert all(e["memcpy_seconds"] > 0 for e in publishes)
    assert len([e for e in events if e["event"] == "step"]) == 2


def _netns_or_skip() -> None:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("a private network namespace needs unshare and root")
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -n is not permitted here")


@pytest.mark.timeout(300)
def test_broadcast_group_publishes_exact_bytes(tiny_dir):
    """The torch.distributed fallback: rank 0 broadcasts a publication over a group built
    with SGLang's rendezvous (its TCP store listens on all interfaces: a private namespace);
    two receivers load exactly the bytes sent."""
    _netns_or_skip()
    r = _in_private_netns(f"{sys.executable} {HERE / '_broadcast_check.py'} {tiny_dir}", 240)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.strip().splitlines()]
    sender, *receivers = lines
    assert sender["rank"] == 0 and sender["sent"] >= 6_000_000
    assert [x["rank"] for x in receivers] == [1, 2]
    assert all(x["equal"] and x["received"] == sender["sent"] for x in receivers)


@pytest.mark.timeout(400)
def test_a_run_publishes_through_a_broadcast_group(tmp_path):
    """weight_transfer = broadcast: the core broadcasts each publication to every other cell
    over one torch.distributed group (gloo here); joins of a subset of cells go by ZeroMQ."""
    _netns_or_skip()
    run = tmp_path / "run"
    events = _up_in_private_netns(run, "weight_transfer=broadcast", "group_size=4")
    publishes = [e for e in events if e["event"] == "publish"]
    assert publishes and all(e["transfer"] == "broadcast" and e["bytes"] > 6_000_000 for e in publishes)
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 2
    # Trained on rollouts of the broadcast weights: behaviour and trainer log-probs agree.
    assert steps[1]["staleness"] == [0] * len(steps[1]["staleness"])
    assert abs(steps[1]["mismatch"]) < 1e-3
    log = "".join(p.read_text() for p in (run / "logs").glob("workerd-*.log"))
    assert "Traceback" not in log

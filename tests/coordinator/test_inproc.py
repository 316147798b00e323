"""`workers = "inproc"`: the same run with one worker thread per cell in the coordinator's
process, no workerd started, no socket between them; its zmq twin starts two processes."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.main import Coordinator
from gyre.workerd.inproc import InprocWorkers


def workerd_children() -> list[int]:
    """This process's children running `gyre workerd`, read from /proc."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        if ppid == me and b"workerd" in argv:
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize("workers", ["inproc", "local"])
async def test_a_run_on_inproc_workers_starts_no_workerd(tiny_dir, tmp_path, workers):
    cfg = CoordinatorConfig(run_dir=tmp_path / "run", model_dir=tiny_dir, steps=2, cells=2, groups_per_step=2,
                            group_size=2, min_valid=1, workers=workers)
    seen: list[tuple[list[int], set[str]]] = []

    def at_step(report) -> None:
        seen.append((workerd_children(), {t.name for t in threading.enumerate()}))

    coord = Coordinator(cfg, on_step=at_step, workers=InprocWorkers() if workers == "inproc" else None)
    reports = await coord.run()
    assert [r.step for r in reports] == [1, 2] and all(r.tokens_trained > 0 for r in reports)
    assert len(seen) == 2
    for children, threads in seen:
        if workers == "inproc":
            assert children == [] and {"gyre-inproc-local-0", "gyre-inproc-local-1"} <= threads
        else:
            assert len(children) == 2 and not any(t.startswith("gyre-inproc") for t in threads)
    if workers == "inproc":  # every worker thread ended with the run
        assert not [t.name for t in threading.enumerate() if t.name.startswith("gyre-inproc")]


def test_inproc_comes_with_its_workers(tiny_dir, tmp_path):
    cfg = CoordinatorConfig(run_dir=tmp_path / "run", model_dir=tiny_dir, workers="inproc")
    with pytest.raises(ValueError, match="in-process workers come together"):
        Coordinator(cfg)
    with pytest.raises(ValueError, match="in-process workers come together"):
        Coordinator(CoordinatorConfig(run_dir=tmp_path / "run", model_dir=tiny_dir), workers=InprocWorkers())
    with pytest.raises(ValueError, match="keys_dir is for workerds over ZeroMQ"):
        CoordinatorConfig(run_dir=tmp_path / "run", model_dir=tiny_dir, workers="inproc", keys_dir=tmp_path)

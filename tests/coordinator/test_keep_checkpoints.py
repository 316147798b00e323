"""keep_checkpoints: a long run keeps the newest N checkpoints, not every one (a real model's
are GBs each). Before, every checkpoint stayed and the run directory grew without bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.resume import CHECKPOINTS, prune_checkpoints, step_dir, write_state
from tests.coordinator.scripted import HARNESS, write_tasks
from tests.inproc import coordinator


def _checkpoint(run_dir: Path, step: int, *, complete: bool = True) -> None:
    folder = step_dir(run_dir, step)
    folder.mkdir(parents=True)
    (folder / "trainer.pt").write_bytes(b"w")
    if complete:
        write_state(run_dir, step, {"step": step})


def _steps(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / CHECKPOINTS).glob("step-*"))


def test_the_newest_complete_checkpoints_stay(tmp_path):
    for s in (2, 4, 6, 8):
        _checkpoint(tmp_path, s)
    _checkpoint(tmp_path, 3, complete=False)  # a save cut short: not counted, not touched
    _checkpoint(tmp_path, 10)  # past the step just written (a stretch lost to a kill -9)
    assert prune_checkpoints(tmp_path, 8, 2) == [2, 4]
    assert _steps(tmp_path) == ["step-000003", "step-000006", "step-000008", "step-000010"]
    assert prune_checkpoints(tmp_path, 8, 2) == []  # idempotent


def test_zero_keeps_every_checkpoint(tmp_path):
    for s in (1, 2, 3):
        _checkpoint(tmp_path, s)
    assert prune_checkpoints(tmp_path, 3, 0) == []
    assert len(_steps(tmp_path)) == 3
    assert prune_checkpoints(tmp_path / "nothing", 3, 1) == []  # no checkpoints folder yet


def test_a_negative_count_is_refused(tmp_path):
    with pytest.raises(ValueError, match="keep_checkpoints must be >= 0, got -1"):
        CoordinatorConfig(run_dir=tmp_path, model_dir=tmp_path, keep_checkpoints=-1)


@pytest.mark.timeout(300)
async def test_a_run_keeps_its_newest_checkpoints_and_says_what_it_deleted(tiny_dir, tmp_path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", 3)
    cfg = CoordinatorConfig(run_dir=tmp_path / "run", model_dir=tiny_dir, steps=3, cells=2, groups_per_step=1,
                            group_size=2, min_valid=2, checkpoint_every=1, keep_checkpoints=2,
                            harness=HARNESS, tasks_path=tasks, default_max_tokens=8)
    await coordinator(cfg).run()
    assert _steps(cfg.run_dir) == ["step-000002", "step-000003"]
    assert (cfg.run_dir / CHECKPOINTS / "latest").read_text().strip() == "step-000003"
    assert (step_dir(cfg.run_dir, 3) / "trainer.pt").exists()
    events = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    saved = [(e["step"], e.get("deleted")) for e in events if e.get("event") == "checkpoint"]
    assert saved == [(1, None), (2, None), (3, [1])]

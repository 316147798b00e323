"""What a long run keeps in memory: an execution's tree and call records go from the proxy
once its group is trained (or dropped) and a checkpoint has them on disk; the files stay
and read back whole. Before, every execution's recorder stayed for the whole run
(bench/soak.py: the coordinator grew with every execution it ran)."""

from __future__ import annotations

import pytest

from gyre.coordinator.config import CoordinatorConfig
from gyre.proxy.records import load_execution
from tests.coordinator.scripted import HARNESS, write_tasks
from tests.inproc import coordinator


@pytest.mark.timeout(300)
async def test_trained_executions_leave_memory_at_checkpoints_and_stay_on_disk(tiny_dir, tmp_path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", 3)
    cfg = CoordinatorConfig(run_dir=tmp_path / "run", model_dir=tiny_dir, steps=3, cells=2, groups_per_step=1,
                            group_size=2, min_valid=2, phi=1, mu=1, checkpoint_every=2,
                            harness=HARNESS, tasks_path=tasks, default_max_tokens=8)
    held: dict[int, set[int]] = {}  # at each step's end: the consumed groups whose recorders the proxy holds

    def at_step(rep) -> None:
        held[rep.step] = {g.id for g in coord.buffer.groups.values() if g.state == "consumed"
                          and any(r.id in coord.proxy.executions for r in g.runs)}

    coord = coordinator(cfg, on_step=at_step)
    await coord.run()

    groups = coord.buffer.groups.values()
    consumed = [r for g in groups if g.state == "consumed" for r in g.runs]
    pending = [r for g in groups if g.state != "consumed" for r in g.runs if r.closed]
    assert len(consumed) == 3 * 2 and pending  # phi = 1: a step's worth in flight at the end, cancelled
    assert all(r.recorder is None and r.id not in coord.proxy.executions for r in consumed)
    # What a resume would read again stays: the pending groups' executions (cancelled by the stop).
    assert all(r.id in coord.proxy.executions for r in pending if r.recorder is not None)
    # Between checkpoints what was trained stays in memory; the checkpoint at step 2 let go of
    # steps 1 and 2's groups, so at step 3's end only step 3's own is held.
    assert sorted(held) == [1, 2, 3]
    assert len(held[1]) == 1 and len(held[2]) == 2 and len(held[3]) == 1 and held[3].isdisjoint(held[2])
    # The records on disk are whole: each released execution reads back, its calls and tree.
    for r in consumed:
        rec = load_execution(cfg.run_dir / "executions" / r.id)
        assert rec.calls and len(rec.tree.nodes) > 1, r.id

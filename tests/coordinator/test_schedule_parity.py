"""Runs and `gyre sim` ask one scheduler the same question. A simulated run records every
situation its scheduler saw; each is replayed into a real Coordinator's own objects (its
waterlevel counters, trajectory buffer, roles, switch tasks, training batch and side
task), and the coordinator's tick must read them as the same `State` and reach the same
decisions."""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path

import pytest

from gyre.coordinator.buffer import Group, TrajectoryBuffer
from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.main import Coordinator
from gyre.coordinator.schedule import State, decide
from gyre.coordinator.sim import Workload, _Sim
from gyre.coordinator.waterlevel import Waterlevel

W = Workload(name="parity", cells=4, cell_nodes=1, group_size=4, groups_per_step=3, exec_slots_per_cell=6,
             timeout_h=2.0, train_h_all=0.3, micro_steps_per_group=2, exec_median_h=0.5, query_sigma=0.3,
             exec_sigma=0.4, hard_frac=0.05, hard_mult=3.0, switch_to_train_s=300.0, switch_to_rollout_s=120.0)


def recorded(policy: str, phi: float, mu: int, steps: int, seed: int) -> list[tuple[float, State, object]]:
    sim = _Sim(W, policy, phi, mu, seed, 0, 2 if policy.startswith("async") else None)
    sim.record = True
    sim.run(steps)
    return sim.decisions


def mirror(coord: Coordinator, s: State, pending: asyncio.Future) -> None:
    """Set the coordinator's own objects to the situation `s` describes."""
    coord.wl = Waterlevel()
    tracked = coord.wl.dispatch(s.queued + s.running)
    for t in tracked[:s.running]:
        coord.wl.launch(t)
    coord.buffer = TrajectoryBuffer(1)
    for gid in range(s.ready_groups):
        group = Group(gid, None, 0, 1)
        coord.buffer.add(group)
        coord.buffer._ready[gid] = group
    coord.cells.roles = list(s.roles)
    coord.cells.dead, coord.cells.no_reducer = set(s.dead), set(s.no_reducer)
    coord.cells.switch_tasks = {c: pending for c in s.switching}
    steps = coord.steps
    steps.steps_done, steps.steps_in_burst = s.steps_done, s.steps_in_burst
    coord.side_task = pending if s.transfer else None
    steps.batch, steps.step_task = None, None
    if s.batch is not None:
        b = s.batch
        batch = steps.new_batch(list(b.members))
        batch.packing_done = b.packing_done
        batch.pending = deque([None] * (b.unclaimed - (0 if b.packing_done else 1)))
        batch.busy = set(s.busy)
        steps.batch, steps.step_task = batch, pending


@pytest.mark.parametrize("policy,phi,mu", [("elastic", 0.5, 3), ("elastic", 0.0, 1), ("colocate", 0.0, 2),
                                           ("async", 1.0, 1), ("async-streaming", 0.5, 2)])
async def test_the_tick_reads_every_simulated_situation_alike(policy, phi, mu, tiny_dir: Path, tmp_path: Path):
    steps = 12
    trail = recorded(policy, phi, mu, steps, seed=4)
    assert len(trail) > 100
    cfg = CoordinatorConfig(run_dir=tmp_path / "run", model_dir=tiny_dir, policy=policy, cells=W.cells,
                            steps=steps, mu=mu, phi=phi, groups_per_step=W.groups_per_step,
                            group_size=W.group_size, exec_slots_per_cell=W.exec_slots_per_cell,
                            async_training_cells=2 if policy.startswith("async") else 1)
    coord = Coordinator(cfg)
    pending = asyncio.get_running_loop().create_future()
    kinds = set()
    for _, s, d in trail:
        mirror(coord, s, pending)
        assert coord.schedule_state() == s
        assert decide(coord.schedule_state()) == d
        kinds |= {k for k in ("launch", "publish", "switches", "joins", "start_step") if getattr(d, k)}
    expected = {"launch", "publish", "start_step"} | ({"switches"} if not policy.startswith("async") else set())
    assert expected <= kinds  # the trail exercised the decisions that matter for this policy
    if policy == "elastic":
        assert "joins" in kinds
    pending.cancel()

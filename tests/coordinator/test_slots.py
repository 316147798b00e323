"""The `slots` events (coordinator/cells.py): each cell's homed executions and the executions
running in all, time-weighted over each interval, from the tick's samples."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from gyre.coordinator.cells import Cells, Occupancy
from gyre.coordinator.metrics import Metrics
from gyre.coordinator.routing import RoutingTable

samples = st.lists(st.tuples(st.floats(0.01, 5.0), st.lists(st.integers(0, 8), min_size=3, max_size=3),
                             st.integers(0, 24)), min_size=2, max_size=40)


@given(samples)
def test_each_interval_is_the_time_weighted_mean_of_what_was_held(steps):
    occ = Occupancy(every_s=10.0)
    t, events = 0.0, []
    integral, running, start = [0.0] * 3, 0.0, 0.0
    assert occ.sample(t, [0, 0, 0], 0) is None  # the first sample opens the interval
    held = ([0, 0, 0], 0)
    for dt, homed, run in steps:
        t += dt
        for i in range(3):
            integral[i] += held[0][i] * dt
        running += held[1] * dt
        held = (homed, run)
        ev = occ.sample(t, homed, run)
        if ev is not None:
            span = t - start
            assert span >= 10.0 and ev["seconds"] == round(span, 3)
            assert ev["homed"] == [round(x / span, 3) for x in integral]
            assert ev["running"] == round(running / span, 3)
            events.append(ev)
            integral, running, start = [0.0] * 3, 0.0, t
    assert len(events) <= t // 10.0  # at most one per 10 s


def test_cells_emit_slots_from_the_routes_homes(tmp_path):
    clock = [0.0]
    cells = Cells(["rollout", "rollout"], now=lambda: clock[0])
    cells.nodes = ["n0", "n1"]
    cells.table = RoutingTable()
    cells.table.set_nodes(["n0", "n1"])
    cells.metrics = Metrics(tmp_path / "metrics.jsonl")
    for ex in ("a", "b", "c"):
        cells.table.pick(ex)  # homed at first call, on the least loaded engine
    homed = sorted(len(cells.table.routes[n].homes) for n in ("n0", "n1"))
    assert homed == [1, 2]
    cells.sample_slots(running=5)
    clock[0] = 12.0
    cells.sample_slots(running=3)
    cells.metrics.close()
    (event,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert event["event"] == "slots" and event["seconds"] == 12.0 and event["running"] == 5.0
    assert sorted(event["homed"]) == [1.0, 2.0]

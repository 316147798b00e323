"""The simulator: preset calibration, the staleness identity, the invariants the real
policies must keep on every event, determinism, compare()'s shape, rendering, and a
workload rebuilt from a run's metrics.jsonl."""

from __future__ import annotations

import json
import math
import random
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gyre.cli.timeline import compare_runs_svg, role_timeline_svg, role_timeline_text
from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.sim import (
    PRESETS,
    SimError,
    Workload,
    compare,
    dispatch_target,
    duration_stats,
    matched_pairs,
    matched_settings,
    sample_query,
    simulate,
    workload_from_metrics,
)

# Small enough for hundreds of steps in well under a second.
TINY = Workload(name="tiny", cells=4, cell_nodes=1, group_size=4, groups_per_step=4, exec_slots_per_cell=8,
                timeout_h=2.0, train_h_all=0.3, micro_steps_per_group=2, exec_median_h=0.5, query_sigma=0.3,
                exec_sigma=0.4, hard_frac=0.05, hard_mult=3.0)


def test_nl2repo_preset_matches_the_papers_statistics():
    s = duration_stats(PRESETS["nl2repo"], queries=2000, seed=0)
    assert s["mean_exec_h"] == pytest.approx(1.93, abs=0.1)
    assert s["mean_query_h"] == pytest.approx(2.96, abs=0.15)
    assert s["query_cap_frac"] == pytest.approx(0.0951, abs=0.02)
    assert s["exec_timeout_frac"] == pytest.approx(0.0625, abs=0.015)


@pytest.mark.parametrize("name", ["deepswe", "terminalbench"])
def test_short_presets_are_short(name):
    w = PRESETS[name]
    s = duration_stats(w, queries=1000, seed=0)
    assert 0.3 <= s["mean_exec_h"] <= 0.6 and 1.0 <= w.timeout_h <= 2.0
    assert (w.cells, w.cell_nodes, w.groups_per_step, w.exec_slots_per_cell) == (6, 4, 48, 192)


@pytest.mark.parametrize("phi,mu", [(0.0, 1), (0.5, 3), (1.5, 2), (0.25, 4)])
def test_dispatch_target_is_the_configs(phi, mu):
    cfg = CoordinatorConfig(run_dir=Path("r"), model_dir=Path("m"), phi=phi, mu=mu, groups_per_step=5)
    assert dispatch_target(phi, mu, 5, 0) == cfg.initial_groups
    assert [dispatch_target(phi, mu, 5, p) for p in range(6)] == [cfg.dispatch_target(p) for p in range(6)]


@pytest.mark.parametrize("policy,phi,mu,t", [("async", 1.5, 1, 2), ("async", 0.5, 1, 1), ("async-streaming", 1.5, 1, 2),
                                             ("async", 0.5, 2, 2), ("colocate", 0.0, 4, None),
                                             ("colocate", 0.0, 2, None), ("elastic", 0.5, 3, None),
                                             ("elastic", 0.0, 2, None), ("elastic", 1.0, 1, None)])
def test_staleness_identity(policy, phi, mu, t):
    r = simulate(TINY, policy=policy, phi=phi, mu=mu, steps=200, seed=3, async_training_cells=t)
    assert r.staleness_mean == pytest.approx(phi + (mu - 1) / 2, abs=0.1)


def _traced(policy, **kw):
    return _traced_on(TINY, policy, **kw)


def _traced_on(workload, policy, **kw):
    events = []
    r = simulate(workload, policy=policy, trace=lambda t, s, phases: events.append((t, s, phases)), **kw)
    return r, events


def _is_prefix(flags) -> bool:
    k = sum(flags)
    return all(flags[:k])


@pytest.mark.parametrize("policy,phi,mu,standalone", [("elastic", 0.5, 3, 0), ("elastic", 0.0, 1, 8),
                                                      ("colocate", 0.0, 4, 0), ("async", 1.5, 1, 0),
                                                      ("async-streaming", 1.0, 1, 0)])
def test_invariants_on_every_event(policy, phi, mu, standalone):
    r, events = _traced(policy, phi=phi, mu=mu, steps=40, seed=1, standalone=standalone,
                        async_training_cells=2 if policy.startswith("async") else None)
    times = [t for t, _, _ in events]
    assert times == sorted(times) and r.hours == pytest.approx(times[-1])
    for _, s, phases in events:
        assert s.queued >= 0 and s.running >= 0 and s.waterlevel >= 0 and s.ready_groups >= 0
        assert _is_prefix([r == "training" for r in s.roles])  # target roles
        assert _is_prefix([p == "training" for p in phases])  # cells actually training
        if not s.step_in_flight:
            assert not s.window_open and s.unclaimed == 0
    assert r.mean_waterlevel >= 0 and len(r.step_hours) == r.steps == 40
    assert all(0.0 <= x <= 1.0 for x in r.per_cell_training_share)
    # Replaying the timeline (all changes of one instant together), training cells form a
    # prefix at every point.
    state = {}
    timeline = r.role_timeline
    for i, (t, c, role) in enumerate(timeline):
        state[c] = role
        if i + 1 == len(timeline) or timeline[i + 1][0] != t:
            assert _is_prefix([state.get(cell) == "training" for cell in range(TINY.cells)]), (t, state)


def test_elastic_moves_the_core_first_and_satellites_follow():
    r, events = _traced("elastic", phi=0.5, mu=3, steps=40, seed=2)
    for _, s, _ in events:
        if any(role == "training" for role in s.roles[1:]):
            assert s.roles[0] == "training"
    entries = [(t, c) for t, c, role in r.role_timeline if role == "switching"]
    assert entries and entries[0][1] == 0
    assert max(sum(p == "training" for p in phases) for _, _, phases in events) >= 2  # satellites do join
    assert r.per_cell_training_share[0] >= max(r.per_cell_training_share[1:])
    assert r.switches == sum(role == "switching" for _, _, role in r.role_timeline)


def test_async_never_switches_and_colocate_switches_together():
    for policy in ("async", "async-streaming"):
        a = simulate(TINY, policy=policy, phi=1.5, mu=1, steps=10, seed=0, async_training_cells=1)
        assert a.switches == 0 and a.per_cell_training_share == [1.0, 0.0, 0.0, 0.0]
    c = simulate(TINY, policy="colocate", phi=0.0, mu=2, steps=10, seed=0)
    switch_times = [t for t, _, role in c.role_timeline if role == "switching"]
    assert len(switch_times) == c.switches and c.switches % TINY.cells == 0
    assert len(set(c.per_cell_training_share)) == 1


def test_same_seed_same_run_and_other_seed_differs():
    kw = dict(policy="elastic", phi=0.5, mu=3, steps=20)
    assert simulate(TINY, seed=7, **kw) == simulate(TINY, seed=7, **kw)
    assert simulate(TINY, seed=7, **kw).hours != simulate(TINY, seed=8, **kw).hours


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        simulate(TINY, policy="nope", phi=0, mu=1, steps=1, seed=0)
    with pytest.raises(ValueError):
        simulate(TINY, policy="async", phi=0, mu=1, steps=1, seed=0, async_training_cells=4)
    with pytest.raises(ValueError):
        simulate(TINY, policy="elastic", phi=-1, mu=1, steps=1, seed=0)


def test_a_single_cell_elastic_run_does_not_stall():
    one = Workload(name="one", cells=1, cell_nodes=1, group_size=2, groups_per_step=5, exec_slots_per_cell=1,
                   timeout_h=0.5, train_h_all=0.2, micro_steps_per_group=2, exec_median_h=0.5)
    r = simulate(one, policy="elastic", phi=2.3, mu=1, steps=10, seed=0)
    assert r.steps == 10 and r.hours > 0


def test_matched_settings_match_the_paper_at_1_5():
    assert matched_settings(1.5) == {"elastic": (0.5, 3), "async": (1.5, 1), "async-streaming": (1.5, 1),
                                     "colocate": (0.0, 4)}
    for ed in (0.0, 0.5, 1.0, 2.5):
        for phi, mu in [*matched_settings(ed).values(), *matched_pairs(ed)]:
            assert phi >= 0 and phi + (mu - 1) / 2 == pytest.approx(ed)
    assert matched_pairs(1.0) == [(1.0, 1), (0.5, 2), (0.0, 3)]
    assert matched_pairs(0.0) == [(0.0, 1)]


def test_compare_shape():
    out = compare(TINY, ed=1.5, steps=6, seeds=[0, 1])
    json.dumps(out)
    assert out["workload"] == "tiny" and out["ed"] == 1.5 and out["steps"] == 6 and out["seeds"] == [0, 1]
    assert set(out["policies"]) == {"elastic", "async", "async-streaming", "colocate"}
    for p in out["policies"].values():
        assert p["hours"] > 0 and len(p["hours_by_seed"]) == 2
        assert p["hours"] == pytest.approx(sum(p["hours_by_seed"]) / 2)
        assert {"phi", "mu", "staleness_mean", "training_share"} <= set(p) and len(p["training_share"]) == TINY.cells
    for name in ("async", "async-streaming"):
        assert 1 <= out["policies"][name]["training_cells"] < TINY.cells
    for p in out["policies"].values():  # the best of the settings tried at this E[d], each tried once
        assert p["hours"] == min(r["hours"] for r in p["tried"])
        settings = [(r["phi"], r["mu"], r.get("training_cells")) for r in p["tried"]]
        assert len(settings) == len(set(settings)) and {(phi, mu) for phi, mu, _ in settings} <= set(matched_pairs(1.5))
    el = out["policies"]["elastic"]["hours"]
    assert out["speedup"]["vs_async"] == pytest.approx(out["policies"]["async"]["hours"] / el)
    assert out["speedup"]["vs_async_streaming"] == pytest.approx(out["policies"]["async-streaming"]["hours"] / el)
    assert out["speedup"]["vs_colocate"] == pytest.approx(out["policies"]["colocate"]["hours"] / el)


def test_nl2repo_runs_briefly():
    r = simulate(PRESETS["nl2repo"], policy="elastic", phi=0.5, mu=3, steps=3, seed=0)
    assert r.steps == 3 and 1.0 < r.hours < 20.0 and r.switches > 0


def test_timeline_renderings():
    r = simulate(TINY, policy="elastic", phi=0.5, mu=3, steps=10, seed=0)
    text = role_timeline_text(r, width=60)
    rows = [line for line in text.splitlines() if line.startswith("cell")]
    assert len(rows) == TINY.cells and all(len(line.split("|")[1]) == 60 for line in rows)
    assert set("".join(line.split("|")[1] for line in rows)) <= set("RT~") and "T" in rows[0]
    root = ET.fromstring(role_timeline_svg(r))
    rects = root.findall("{http://www.w3.org/2000/svg}rect")
    assert rects and {rect.get("fill") for rect in rects} >= {"#4c8bd6", "#e07b39"}


def _write_run(tmp_path: Path) -> Path:
    lines = []
    for g in range(6):
        for i in range(4):
            t0 = 10.0 * g + i
            status = "timed_out" if (g, i) == (2, 3) else "completed"
            lines.append({"event": "execution", "t": t0 + 60, "id": f"g{g}-{i}", "group": g, "status": status,
                          "reward": 1.0, "valid": True, "version_dispatched": 0, "t_start": t0,
                          "t_end": t0 + (120.0 if status == "timed_out" else 30.0 + 5 * i)})
    lines += [{"event": "step", "t": 100.0 + s, "step": s + 1, "seconds": 20.0 if s % 2 else 10.0,
               "groups": 2, "cells_training": 1 if s % 2 else 2} for s in range(4)]
    lines += [{"event": "role", "t": 5.0, "cell": 0, "from": "rollout", "to": "training", "seconds": 0.5},
              {"event": "role", "t": 9.0, "cell": 0, "from": "training", "to": "rollout", "seconds": 0.25},
              {"event": "publish", "t": 111.0, "version": 1, "seconds": 2.0, "bytes": 10}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (tmp_path / "config.json").write_text(json.dumps({"cells": 2, "group_size": 4, "groups_per_step": 2,
                                                      "exec_slots_per_cell": 8, "execution_timeout_s": 120.0}))
    return path


def test_workload_from_metrics(tmp_path):
    w = workload_from_metrics(_write_run(tmp_path))
    assert (w.cells, w.group_size, w.groups_per_step, w.exec_slots_per_cell) == (2, 4, 2, 8)
    assert w.timeout_h == pytest.approx(120 / 3600)
    assert len(w.empirical_groups_h) == 6 and math.isinf(w.empirical_groups_h[2][3])
    assert w.ordered_groups and sample_query(w, random.Random(0), 8) == list(w.empirical_groups_h[2])  # in order
    assert w.train_h_all == pytest.approx(20.0 / 3600 / 2)  # 20 cell-seconds a step over 2 cells
    assert w.train_h_by_cells == ((1, pytest.approx(20 / 3600)), (2, pytest.approx(10 / 3600)))
    assert (w.switch_to_train_s, w.switch_to_rollout_s, w.publish_s) == (0.5, 0.25, 2.0)
    r = simulate(w, policy="elastic", phi=0.5, mu=1, steps=5, seed=0)
    assert r.steps == 5 and r.hours > 0
    (tmp_path / "config.json").unlink()
    assert workload_from_metrics(tmp_path / "metrics.jsonl").cells == 2


def test_workload_from_metrics_takes_the_runs_own_terms(tmp_path):
    """A cancelled execution is no duration; training is the trainers' own seconds over the
    steps that trained (a streaming step's wall time waits for groups); micro-steps per group
    are the run's; a term the run never measured (no role event: it never switched) keeps the
    paper's figure, and says so."""
    path = _write_run(tmp_path)
    lines = [json.loads(x) for x in path.read_text().splitlines() if '"role"' not in x]
    lines.append({"event": "execution", "t": 70.0, "id": "g0-9", "group": 0, "status": "cancelled", "reward": None,
                  "valid": False, "version_dispatched": 0, "t_start": 1.0, "t_end": 2.0})
    for i, e in enumerate(x for x in lines if x["event"] == "step"):
        e.update(trainer_seconds=3.0 + i, micro_steps=2, trained=True, tokens_trained=100)
    lines.append({"event": "step", "t": 200.0, "step": 5, "seconds": 50.0, "groups": 2, "cells_training": 2,
                  "trainer_seconds": 0.0, "micro_steps": 0, "trained": False, "tokens_trained": 0})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    w = workload_from_metrics(path)
    assert [len(g) for g in w.empirical_groups_h] == [4] * 6  # the cancelled one left out
    assert w.train_h_all == pytest.approx((3 + 4 + 5 + 6) / 4 / 3600 / 2)  # not the step that trained nothing
    assert w.micro_steps_per_group == 1  # 2 micro-steps for 2 groups
    assert (w.switch_to_train_s, w.switch_to_rollout_s, w.publish_s) == (8.52, 3.46, 2.0)
    assert [a.split(":")[0] for a in w.assumed] == ["switch to training", "switch to rollout"]
    assert workload_from_metrics(_write_run(tmp_path)).assumed == (
        "training: step seconds x cells training (no trainer_seconds in the journal)",
        "micro-steps per group: 4 (no micro_steps in the journal)")


def test_workload_from_metrics_needs_events(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "publish", "t": 1.0}) + "\n")
    with pytest.raises(SimError):
        workload_from_metrics(tmp_path / "metrics.jsonl")


def test_elastic_leads_on_nl2repo():
    """The direction of the headline on a short run (the figures themselves: `gyre sim compare`)."""
    kw = dict(steps=12, seed=0)
    elastic = simulate(PRESETS["nl2repo"], policy="elastic", phi=0.5, mu=3, **kw).hours
    colocate = simulate(PRESETS["nl2repo"], policy="colocate", phi=0.0, mu=4, **kw).hours
    def best(policy):
        return min(simulate(PRESETS["nl2repo"], policy=policy, phi=1.5, mu=1, async_training_cells=t, **kw).hours
                   for t in (2, 3, 4))

    assert elastic < best("async-streaming") < colocate
    assert best("async-streaming") < best("async")  # streaming steps start earlier than full batches


def test_a_micro_step_shorter_than_a_role_switch():
    """Satellites still switching when the step they were joining has ended: the training
    cells stay a prefix (a cell past a rollout cell goes back) and the run goes on."""
    quick = Workload(name="quick", cells=4, cell_nodes=1, group_size=4, groups_per_step=2, exec_slots_per_cell=8,
                     timeout_h=2.0, train_h_all=0.0005, micro_steps_per_group=1, exec_median_h=0.3,
                     switch_to_train_s=20.0, switch_to_rollout_s=1.0, publish_s=1.0)
    for seed in range(6):
        r, events = _traced_on(quick, "elastic", phi=1.0, mu=2, steps=30, seed=seed)
        assert r.steps == 30
        for _, _, phases in events:
            assert _is_prefix([p == "training" for p in phases])


def test_compare_runs_svg_stacks_the_runs_on_one_axis_with_each_policys_spread():
    runs = [(f"{i:02d}-{p}", simulate(TINY, policy=p, phi=0.5, mu=1, steps=3, seed=i), s)
            for i, (p, s) in enumerate([("elastic", 20.0), ("colocate", 30.0), ("elastic", 22.0)])]
    root = ET.fromstring(compare_runs_svg(runs))
    ns = "{http://www.w3.org/2000/svg}"
    labels = [t.text for t in root.iter(f"{ns}text")]
    assert {"00-elastic", "01-colocate", "02-elastic"} <= set(labels)  # a band and a bar per run
    policies = [g for g in root.iter(f"{ns}g") if g.get("class") == "policy"]
    assert [g.find(f"{ns}text").text for g in policies] == ["elastic (2)", "colocate (1)"]
    spread = policies[0].find(f"{ns}line")
    assert float(spread.get("x1")) < float(spread.get("x2"))  # 20 s to 22 s
    assert "21.00 s (20.00-22.00)" in [t.text for t in policies[0].iter(f"{ns}text")]

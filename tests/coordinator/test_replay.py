"""Recorded runs replayed by the simulator (coordinator/replay.py, `gyre sim compare --from`),
and the long-tail workload's law (examples/longtail/agent/agent.py)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gyre.cli.main import app
from gyre.coordinator.replay import fit_host, pool, read_run, replay, s_per_step
from gyre.coordinator.sim import simulate
from gyre.coordinator.workloads import SimError

REPO = Path(__file__).resolve().parents[2]


def write_run(run: Path, policy: str, *, phi: float = 0.0, mu: int = 1, tool_s: float = 20.0, trainer_s: float = 4.0,
              switch: bool = True, cells: int = 3, step_s: float = 30.0, group_size: int = 2,
              together_s: float = 0.0, apart_s: float = 0.0) -> Path:
    """A run directory whose metrics.jsonl holds what a real run's does: a start-up, dispatches
    from t = 10, executions, steps, role switches (or none, as async's), a publication. A
    group's executions start together, or `apart_s` apart; with `together_s` each takes that
    much longer per execution started with it, itself included (a host's shared cores)."""
    run.mkdir(parents=True)
    lines = [{"event": "start", "t": 0.0, "t0_wall": 1.0e9, "resumed": False},
             {"event": "ready", "t": 10.0, "startup_s": 10.0},
             {"event": "dispatch", "t": 10.0, "group": 0}]
    for g in range(4):
        for i in range(group_size):
            start = 10.0 + 5 * g + apart_s * i
            own = tool_s * (1 + 0.5 * i) + 3.0 * g
            together = 1 if apart_s > 1.0 else group_size
            lines.append({"event": "execution", "t": start + tool_s, "id": f"g{g:05d}-{i:02d}", "group": g,
                          "status": "completed", "t_start": start, "t_end": start + own + together_s * together})
    if switch:
        lines += [{"event": "role", "t": 40.0, "cell": 0, "from": "rollout", "to": "training", "seconds": 0.02},
                  {"event": "role", "t": 45.0, "cell": 0, "from": "training", "to": "rollout", "seconds": 0.01}]
    lines += [{"event": "step", "t": 10.0 + step_s * (s + 1), "step": s + 1, "seconds": 5.0, "groups": 2,
               "cells_training": 1, "trainer_seconds": trainer_s, "micro_steps": 2, "trained": True,
               "tokens_trained": 100, "staleness_mean": 0.5} for s in range(2)]
    lines.append({"event": "publish", "t": 71.0, "version": 1, "seconds": 0.05, "bytes": 10})
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run / "config.json").write_text(json.dumps({
        "policy": policy, "phi": phi, "mu": mu, "cells": cells, "group_size": group_size, "groups_per_step": 2,
        "exec_slots_per_cell": 4, "execution_timeout_s": 120.0, "async_training_cells": 1}))
    return run


def test_seconds_per_step_count_from_the_first_dispatch(tmp_path):
    run = read_run(write_run(tmp_path / "e", "elastic", step_s=30.0))
    assert (run.s_per_step, run.steps) == (30.0, 2)  # (70 - 10) / 2: the start-up is no step's
    assert run.training_cells is None and read_run(write_run(tmp_path / "a", "async")).training_cells == 1
    with pytest.raises(SimError, match="dispatch and step"):
        s_per_step([{"event": "step", "t": 3.0}])


def test_a_pool_averages_what_the_runs_measured_and_assumes_only_what_none_did(tmp_path):
    elastic = read_run(write_run(tmp_path / "e", "elastic", trainer_s=4.0))
    lone = read_run(write_run(tmp_path / "a", "async", trainer_s=8.0, switch=False))
    w = pool([elastic, lone])
    assert len(w.empirical_groups_h) == 4 and w.ordered_groups  # one task each, in dispatch order
    assert w.empirical_groups_h[1] == (pytest.approx(23 / 3600), pytest.approx(33 / 3600))  # its members by id
    assert w.train_h_all == pytest.approx(6.0 / 3600 / 3)  # the trainers' seconds, averaged
    assert (w.switch_to_train_s, w.switch_to_rollout_s) == (0.02, 0.01)  # elastic measured them; async could not
    assert w.assumed == () and w.micro_steps_per_group == 1
    w = pool([lone, read_run(write_run(tmp_path / "a2", "async-streaming", switch=False))])
    assert [a.split(":")[0] for a in w.assumed] == ["switch to training", "switch to rollout"]
    with pytest.raises(SimError, match="group_size is 4, not 2"):
        pool([elastic, read_run(write_run(tmp_path / "other", "colocate", group_size=4))])


def test_the_host_model_is_the_cost_of_starting_together_fitted_across_runs(tmp_path):
    """The same tasks, their executions starting two at a time in one run and one at a time
    in another, 1.5 s longer per execution started with it: the fit finds 1.5 s, the pool
    takes it out of every duration, and the simulator puts it back at each launch."""
    two = read_run(write_run(tmp_path / "two", "elastic", together_s=1.5))
    alone = read_run(write_run(tmp_path / "one", "async", together_s=1.5, apart_s=2.0, switch=False))
    assert fit_host([two, alone]) == pytest.approx(1.5)
    w = pool([two, alone], host=True)
    assert w.host_start_s == pytest.approx(1.5)
    assert w.empirical_groups_h[0] == (pytest.approx(20 / 3600), pytest.approx(30 / 3600))  # the company's cost out
    assert pool([two, alone]).host_start_s == 0.0  # off unless asked: independent cells
    assert fit_host([two]) == 0.0  # one run: nothing to compare a task with
    slow = simulate(replace(w, host_start_s=30.0), policy="colocate", phi=0.0, mu=1, steps=2, seed=0)
    fast = simulate(replace(w, host_start_s=0.0), policy="colocate", phi=0.0, mu=1, steps=2, seed=0)
    assert slow.hours > fast.hours


def test_replay_sets_each_runs_prediction_beside_its_measurement(tmp_path):
    dirs = [write_run(tmp_path / "01-elastic", "elastic", mu=3), write_run(tmp_path / "02-async", "async", phi=1.0,
                                                                         switch=False, step_s=40.0)]
    out = replay(dirs, seeds=[0, 1])
    assert [(r["policy"], r["phi"], r["mu"], r["training_cells"]) for r in out["runs"]] == [
        ("elastic", 0.0, 3, None), ("async", 1.0, 1, 1)]  # each run's own settings replayed
    for r in out["runs"]:
        assert r["predicted_s_per_step"] > 0
        assert r["error"] == pytest.approx(r["predicted_s_per_step"] / r["measured_s_per_step"] - 1, abs=1e-3)
    p = out["policies"]
    assert p["async"]["measured_vs_elastic"] == pytest.approx(40.0 / 30.0, abs=1e-3)
    assert p["async"]["ratio_error"] == pytest.approx(
        p["async"]["predicted_vs_elastic"] / p["async"]["measured_vs_elastic"] - 1, abs=1e-3)


def test_compare_from_run_directories_on_the_command_line(tmp_path):
    write_run(tmp_path / "01-elastic", "elastic")
    write_run(tmp_path / "02-colocate", "colocate", mu=3)
    (tmp_path / "01-elastic.log").write_text("a log, not a run\n")
    runner = CliRunner()
    paths = sorted(str(p) for p in tmp_path.iterdir())  # as a shell expands DIR/*
    r = runner.invoke(app, ["sim", "compare", "--seeds", "1", "--from", *paths])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"skipped 1 path(s) that are not run directories: {tmp_path / '01-elastic.log'}")
    rows = {line.split()[0]: line.split() for line in r.output.splitlines()}
    assert rows["01-elastic"][1] == "elastic" and rows["02-colocate"][1:4] == ["colocate", "0", "3"]
    assert rows["colocate"][3].endswith("x") and "ratio error" in r.output
    r = runner.invoke(app, ["sim", "compare", "--seeds", "1", "--from", *paths, "--json"])
    assert json.loads(r.output)["policies"]["elastic"]["measured_vs_elastic"] == 1.0
    r = runner.invoke(app, ["sim", "compare", str(tmp_path / "01-elastic")])
    assert r.exit_code == 1 and "run directories are given with --from" in r.output
    r = runner.invoke(app, ["sim", "compare", "--from", str(tmp_path / "01-elastic.log")])
    assert r.exit_code == 1 and r.output.startswith("[error] --from: no run directory")
    r = runner.invoke(app, ["sim", "compare", "--seeds", "1", "--host-model", "--from", *paths])
    assert r.exit_code == 0 and "host model: 0.000 s of start-up per execution started together" in r.output
    r = runner.invoke(app, ["sim", "compare", "--host-model"])
    assert r.exit_code == 1 and "--host-model is fitted from real runs: give them with --from" in r.output


def load_agent():
    spec = importlib.util.spec_from_file_location("longtail_agent", REPO / "examples/longtail/agent/agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_longtail_law_is_the_executions_own_and_heavy_tailed():
    agent = load_agent()
    law = argparse.Namespace(calls=4, median_s=10.0, query_sigma=0.1, exec_sigma=0.3, hard_frac=0.1, hard_mult=4.0,
                             seed=0)
    waits = agent.tool_seconds("g00003-01", law)
    assert len(waits) == 4 and all(w > 0 for w in waits)
    assert agent.tool_seconds("g00003-01", law) == waits  # the same under every policy, every run
    assert agent.tool_seconds("g00003-02", law) != waits
    totals = sorted(sum(agent.tool_seconds(f"g{g:05d}-00", law)) for g in range(400))
    median = totals[200]
    assert 8.0 < median < 12.5 and totals[-1] > 3 * median  # a tail of hard groups
    hard = sum(t > 2.5 * median for t in totals) / len(totals)
    assert 0.05 < hard < 0.16, hard
    assert not math.isclose(sum(waits), 0.0)


@pytest.mark.parametrize("name", ["nl2repo", "swe", "terminal"])
def test_the_longtail_presets_are_run_configs_gyre_reads(name):
    from gyre.coordinator.harnesses import resolve
    from gyre.coordinator.runconfig import build_config, load_config_file

    values = load_config_file(REPO / "examples" / "longtail" / f"{name}.toml")
    cfg = build_config(file_values=values, overrides={"run_dir": Path("runs/x"), "model_dir": Path("runs/x/model")})
    assert cfg.harness == "longtail" and cfg.cells == 3 and cfg.tasks_path == REPO / "examples/longtail/tasks.jsonl"
    preset = resolve(cfg.harness, cfg.harnesses)
    argv, _, _ = preset.expand(task="t", workspace="/w", execution="g0-0", state="/s", base_url="b",
                               openai_base_url="b/v1", api_key="k", timeout_ms="1")
    assert argv[:2] == [sys.executable, "/w/agent.py"]  # {python}: the Python running gyre
    assert preset.missing(contained=False) is None

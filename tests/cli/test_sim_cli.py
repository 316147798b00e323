"""`gyre sim` and `gyre sim compare` from the command line (JSON contracts)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gyre.cli.main import app

runner = CliRunner()


def test_sim_json_and_timeline(tmp_path):
    svg = tmp_path / "t.svg"
    r = runner.invoke(app, ["sim", "--workload", "terminalbench", "--policy", "elastic", "--phi", "0.5", "--mu", "3",
                            "--steps", "6", "--seed", "1", "--json", "--timeline", str(svg)])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["policy"] == "elastic" and out["steps"] == 6 and out["hours"] > 0
    assert len(out["training_share"]) == 6 and svg.read_text().startswith("<svg")


def test_sim_text_shows_the_role_timeline():
    r = runner.invoke(app, ["sim", "--workload", "deepswe", "--steps", "4"])
    assert r.exit_code == 0, r.output
    assert "cell  0 |" in r.output and "T" in r.output


def test_compare_json_contract():
    r = runner.invoke(app, ["sim", "compare", "--workload", "terminalbench", "--steps", "6", "--seeds", "1",
                            "--ed", "1.5", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert set(out["policies"]) == {"elastic", "async", "async-streaming", "colocate"}
    for name, p in out["policies"].items():
        assert p["hours"] > 0
        assert p["phi"] + (p["mu"] - 1) / 2 == pytest.approx(1.5)  # each setting at the asked E[d]
        assert ("training_cells" in p) == name.startswith("async")
        assert p["hours"] == min(r["hours"] for r in p["tried"])  # the fastest setting tried is reported
    for key, name in (("vs_async", "async"), ("vs_async_streaming", "async-streaming"), ("vs_colocate", "colocate")):
        assert out["speedup"][key] == pytest.approx(
            out["policies"][name]["hours"] / out["policies"]["elastic"]["hours"])


def test_training_cells_fix_the_async_split():
    out = {}
    for t in (1, 3):
        r = runner.invoke(app, ["sim", "--workload", "terminalbench", "--policy", "async", "--training-cells", str(t),
                                "--steps", "4", "--json"])
        assert r.exit_code == 0, r.output
        out[t] = json.loads(r.output)
        assert out[t]["training_cells"] == t and out[t]["assumed"] == []
    assert out[1]["hours"] != out[3]["hours"]
    shares = [sum(x > 0 for x in out[t]["training_share"]) for t in (1, 3)]
    assert shares == [1, 3]  # only the fixed split's cells ever train


def test_a_recorded_run_of_minutes_prints_in_minutes_or_seconds_and_names_what_it_assumed(tmp_path):
    """A run's metrics.jsonl without role events (it never switched): its switch times are
    the paper's, said so; a table of a minute-scale workload is not in hundredths of hours."""
    lines = [{"event": "execution", "t": 30.0 + i, "id": f"g{g}-{i}", "group": g, "status": "completed",
              "t_start": 10.0 * g, "t_end": 10.0 * g + 20.0 + 3 * i} for g in range(4) for i in range(2)]
    lines += [{"event": "step", "t": 60.0 + s, "step": s + 1, "seconds": 6.0, "groups": 1, "cells_training": 1,
               "trainer_seconds": 4.0, "micro_steps": 1, "trained": True, "tokens_trained": 50} for s in range(3)]
    lines.append({"event": "publish", "t": 70.0, "version": 1, "seconds": 0.2, "bytes": 10})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "config.json").write_text(json.dumps({"cells": 3, "group_size": 2, "groups_per_step": 1,
                                                      "exec_slots_per_cell": 2, "execution_timeout_s": 60.0}))
    r = runner.invoke(app, ["sim", "--workload", str(tmp_path / "metrics.jsonl"), "compare", "--steps", "3",
                            "--seeds", "1", "--ed", "1"])
    assert r.exit_code == 0, r.output
    assert "assumed, not measured in " in r.output and "switch to training: 8.52 s" in r.output, r.output
    header = next(line for line in r.output.splitlines() if line.startswith("policy"))
    assert header.split()[4] in ("min", "s"), header


def test_unknown_workload_is_a_one_line_error():
    r = runner.invoke(app, ["sim", "--workload", "nope"])
    assert r.exit_code == 1 and r.output.startswith("[error] unknown workload") and len(r.output.splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["sim", "--policy", "bogus"], "--policy must be one of"),
    (["sim", "--steps", "0"], "--steps must be >= 1"),
    (["sim", "--cells", "0"], "--cells must be >= 1"),
    (["sim", "--mu", "0"], "--mu must be >= 1"),
    (["sim", "compare", "--seeds", "0"], "--seeds must be >= 1"),
    (["sim", "compare", "--steps", "0"], "--steps must be >= 1"),
    (["sim", "--cells", "1", "compare"], "compare needs at least 2 cells"),
    (["sim", "--policy", "async", "--training-cells", "0"], "--training-cells must be >= 1"),
    (["sim", "--policy", "elastic", "--training-cells", "1"], "--training-cells sets a fixed split"),
    (["sim", "--workload", "terminalbench", "--policy", "async", "--training-cells", "6"],
     "async needs 1 <= async_training_cells < 6, got 6"),
])
def test_bad_sim_options_are_one_line_errors(args, message):
    r = runner.invoke(app, args)
    assert r.exit_code == 1, r.output
    assert r.output.startswith(f"[error] {message}") and len(r.output.splitlines()) == 1, r.output

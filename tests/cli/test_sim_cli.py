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
])
def test_bad_sim_options_are_one_line_errors(args, message):
    r = runner.invoke(app, args)
    assert r.exit_code == 1, r.output
    assert r.output.startswith(f"[error] {message}") and len(r.output.splitlines()) == 1, r.output

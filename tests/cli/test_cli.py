"""The `gyre` command: version, init-model, placeholders, and `gyre up` end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gyre.cli.main import app

runner = CliRunner()


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.startswith("gyre ")


def test_init_model_writes_a_loadable_directory(tmp_path):
    r = runner.invoke(app, ["init-model", "tiny", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    names = {p.name for p in (tmp_path / "m").iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= names


def test_init_model_unknown_kind_is_one_line_error(tmp_path):
    r = runner.invoke(app, ["init-model", "huge", str(tmp_path / "m")])
    assert r.exit_code == 1 and "[error] unknown model kind 'huge'" in r.output
    assert "Traceback" not in r.output


def test_top_with_no_run_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["top"])
    assert r.exit_code == 1 and "[error] no run directory given" in r.output


def test_workerd_passes_its_config(monkeypatch):
    seen = {}
    import gyre.workerd.server as server

    monkeypatch.setattr(server, "serve", lambda config: seen.setdefault("config", config) and 0)
    r = runner.invoke(app, ["workerd", "--coordinator", "tcp://127.0.0.1:5555", "--cell", "2",
                            "--node-rank", "1", "--devices", "0,1", "--heartbeat", "0.5"])
    assert r.exit_code == 0, r.output
    c = seen["config"]
    assert (c.coordinator, c.cell, c.node_rank, c.devices, c.heartbeat_s) == (
        "tcp://127.0.0.1:5555", 2, 1, ("0", "1"), 0.5)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gyre_up_runs_the_embedded_default(tmp_path):
    """The README's first command as a new user runs it: `gyre up` from a fresh working
    directory, with the default (relative) run directory."""
    gyre = Path(sys.executable).with_name("gyre")  # the console script `pip install -e .` made
    r = subprocess.run([str(gyre), "up", "--steps", "3", "--no-live"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=380)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 3/3" in r.stdout
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.startswith("up-") and f"-> {run}" in r.stdout  # named absolute
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if x["event"] == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3] and [s["version"] for s in steps] == [1, 2, 3]
    assert all(0.0 <= s["reward_mean"] <= 1.0 and s["reward_valid_frac"] == 1.0 for s in steps)
    # Affine routing and the engines' prefix cache are the defaults: the demo harness's calls
    # resend their history, which their home engine has cached.
    assert all(s["prefill_tokens"] > 0 and s["cached_tokens"] > 0 for s in steps)
    assert all(s["cache_hit_rate"] == round(s["cached_tokens"] / (s["cached_tokens"] + s["prefill_tokens"]), 4)
               for s in steps)
    # Tree packing is the default: the forward pass computes each admitted token once.
    assert all(s["packing"] == "tree" and 0 < s["forward_tokens"] == s["unique_admitted_tokens"]
               <= s["expanded_tokens"] and s["trainer_seconds"] > 0 for s in steps)
    assert all(s["loop_lag_ms"]["samples"] > 0 and s["loop_lag_ms"]["max"] >= s["loop_lag_ms"]["p50"] for s in steps)
    assert [x["version"] for x in lines if x["event"] == "publish"] == [1, 2, 3]
    roles = [x for x in lines if x["event"] == "role"]
    assert roles and {(x["from"], x["to"]) for x in roles} == {("rollout", "training"), ("training", "rollout")}
    execs = [x for x in lines if x["event"] == "execution"]
    assert execs and all(x["status"] in ("completed", "timed_out", "harness_error", "placeholder") for x in execs)
    # The default (elastic) at phi=0, mu=1: every group is consumed by the step after its dispatch.
    assert all(s["staleness_mean"] == 0 for s in steps)
    config = json.loads((run / "config.json").read_text())
    assert config["policy"] == "elastic" and config["steps"] == 3
    assert config["run_dir"] == str(run) and config["model_dir"] == str(run / "model")  # absolute: --resume anywhere
    assert (config["lr"], config["default_max_tokens"]) == (3e-3, 16)  # the tiny model's gyre.json


def test_help_texts_keep_their_brackets():
    """No rich markup in help: `[gpu]`, `[harnesses.NAME]` and `E[d]` are text."""
    for args, needle in ((["workerd", "--help"], "'gyre[gpu]'"), (["serve", "--help"], "[harnesses.NAME]"),
                         (["sim", "compare", "--help"], "E[d]")):
        r = runner.invoke(app, args, env={"COLUMNS": "250"})
        assert r.exit_code == 0 and needle in " ".join(r.output.split()), (args, r.output)

"""`gyre serve` + the demo harness + `gyre inspect`: one execution, a branched tree."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from gyre.cli.main import app


@pytest.mark.timeout(240)
def test_serve_demo_harness_inspect(tmp_path):
    run = tmp_path / "run"
    serve = subprocess.Popen([sys.executable, "-m", "gyre.cli", "serve", "--run-dir", str(run), "--port", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = json.loads(serve.stdout.readline())  # blocks until the proxy is up (or the process died)
        assert info["api_key"].startswith("gyre-") and info["base_url"].startswith("http://127.0.0.1:")
        ws = tmp_path / "ws"
        env = dict(os.environ, OPENAI_BASE_URL=info["openai_base_url"], OPENAI_API_KEY=info["api_key"])
        h = subprocess.run([sys.executable, "-m", "gyre.coordinator.demo_harness", "--workspace", str(ws), "--task",
                            "Write hello to a.txt", "--force-compaction", "--force-subagent", "--max-turns", "3"],
                           env=env, capture_output=True, text=True, timeout=180)
        assert h.returncode == 0, h.stderr
        stats = json.loads(h.stdout.strip().splitlines()[-1])
        assert stats["compactions"] == 1 and stats["subagents"] == 1
        assert (ws / "answer.txt").exists()
    finally:
        serve.send_signal(signal.SIGINT)
        _, err = serve.communicate(timeout=60)
    assert serve.returncode == 0, err[-2000:]

    r = CliRunner().invoke(app, ["inspect", str(run), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    (ex,) = out["executions"]
    assert ex["execution"] == "serve" and ex["roots"] == 2  # main + the sub-agent's own root
    assert ex["leaf_roles"].get("main-summary") == 1 and ex["leaf_roles"].get("sub-agent") == 1
    assert ex["leaf_roles"].get("main", 0) >= 1
    assert ex["unique_tokens"] < ex["tree_expanded_tokens"]  # the shared prefix is stored once
    # Training at J_max: the tree form forwards the admitted paths' union, each node once.
    assert ex["forward_tokens_tree"] == ex["unique_admitted_tokens"] <= ex["unique_tokens"]
    assert ex["unique_admitted_tokens"] < ex["expanded_tokens"] == ex["admission_j5"]["forward_tokens"]
    assert ex["status"] == {"ok": ex["calls"]}
    # Its turns resend the history, which the engine's prefix cache holds (one engine here).
    assert ex["cached_tokens"] > 0 and ex["prefill_tokens"] > 0
    assert ex["cache_hit_rate"] == round(ex["cached_tokens"] / (ex["cached_tokens"] + ex["prefill_tokens"]), 4)
    # A client drove it, nobody scored it: no status of its own, no reward made up.
    assert (ex["execution_status"], ex["reward"]) == ("unknown", None)
    assert (out["run"]["command"], out["run"]["calls"], out["run"]["cached_tokens"]) == (
        "serve", ex["calls"], ex["cached_tokens"])
    text = CliRunner().invoke(app, ["inspect", str(run)])
    assert text.exit_code == 0 and "main-summary leaf" in text.output and "sub-agent leaf" in text.output
    assert text.output.index("gyre serve run") < text.output.index("main-summary leaf")


def test_inspect_of_a_non_run_is_a_one_line_error(tmp_path):
    r = CliRunner().invoke(app, ["inspect", str(tmp_path)])
    assert r.exit_code == 1 and "[error]" in r.output and "executions/" in r.output


@pytest.mark.timeout(240)
def test_serve_executions_gives_each_client_its_own_key_and_execution(tmp_path):
    run = tmp_path / "run"
    serve = subprocess.Popen([sys.executable, "-m", "gyre.cli", "serve", "--run-dir", str(run), "--executions", "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = json.loads(serve.stdout.readline())
        assert info["executions"] == ["serve-1", "serve-2"] and len(set(info["api_keys"])) == 2
        assert info["api_key"] == info["api_keys"][0]
        for i, key in enumerate(info["api_keys"]):  # two harnesses, concurrently as far as the proxy knows
            env = dict(os.environ, OPENAI_BASE_URL=info["openai_base_url"], OPENAI_API_KEY=key)
            h = subprocess.run([sys.executable, "-m", "gyre.coordinator.demo_harness",
                                "--workspace", str(tmp_path / f"w{i}"), "--task", f"Write {i} to a.txt",
                                "--max-turns", "1"], env=env, capture_output=True, text=True, timeout=180)
            assert h.returncode == 0, h.stderr
    finally:
        serve.send_signal(signal.SIGINT)
        _, err = serve.communicate(timeout=60)
    assert serve.returncode == 0, err[-2000:]
    r = CliRunner().invoke(app, ["inspect", str(run), "--json"])
    listed = json.loads(r.output)["executions"]
    assert [e["execution"] for e in listed] == ["serve-1", "serve-2"]
    assert all(e["roots"] == 1 and set(e["leaf_roles"]) == {"main"} for e in listed)  # nobody's sub-agent
    bad = CliRunner().invoke(app, ["serve", "--executions", "0"])
    assert bad.exit_code == 1 and "--executions must be >= 1" in bad.output

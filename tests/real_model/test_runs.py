"""SmolLM2 end to end, as a user runs it: `gyre serve --harness demo` once, and a 2-step
`gyre up --model DIR` with settings a 135M model on 2 CPU cores can carry (the per-step
seconds and the workers' peak memory are printed for the notes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

GYRE = [sys.executable, "-m", "gyre.cli"]


@pytest.mark.timeout(300)
def test_serve_runs_the_demo_harness_on_smollm2(smollm2_dir, tmp_path):
    run = tmp_path / "serve"
    r = subprocess.run([*GYRE, "serve", "--model", str(smollm2_dir), "--run-dir", str(run), "--harness", "demo",
                        "--task", "Write hello to hello.txt.", "--set", "default_max_tokens=48", "--timeout", "240"],
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["status"] == "completed" and summary["calls"] >= 1
    config = json.loads((run / "config.json").read_text())
    assert (config["max_context"], config["default_max_tokens"], config["max_tokens_cap"]) == (8192, 48, None)
    calls = [json.loads(x) for x in (run / "executions" / "serve" / "calls.jsonl").read_text().splitlines()]
    assert all(c["status"] == "ok" and 0 < c["output_tokens"] <= 48 for c in calls)
    assert all(c["sampling"]["temperature"] == 1.0 and c["sampling"]["client_temperature"] == 1.0 for c in calls)


@pytest.mark.timeout(600)
def test_two_steps_of_gyre_up_on_smollm2(smollm2_dir, tmp_path, capsys):
    run = tmp_path / "up"
    sets = ["cells=2", "groups_per_step=1", "group_size=2", "min_valid=1", "default_max_tokens=32",
            "execution_timeout_s=240", "micro_step_tokens=4096", "policy=colocate", "workers=inproc"]
    r = subprocess.run([*GYRE, "up", "--model", str(smollm2_dir), "--run-dir", str(run), "--steps", "2", "--no-live",
                        *(x for s in sets for x in ("--set", s))], capture_output=True, text=True, timeout=560)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert [s["step"] for s in steps] == [1, 2] and sum(s["tokens_trained"] for s in steps) > 0
    # A group's executions sampled differently (each cell its own seed): their rewards differ.
    by_group: dict[int, list] = {}
    for e in events:
        if e["event"] == "execution":
            by_group.setdefault(e["group"], []).append(e["reward"])
    assert any(len(set(r)) > 1 for r in by_group.values()), by_group
    assert all(abs(s["mismatch"]) < 1e-3 for s in steps if s["mismatch"] is not None)
    config = json.loads((run / "config.json").read_text())
    assert (config["lr"], config["max_context"]) == (1e-6, 8192)  # real-model defaults
    (summary,) = [e for e in events if e["event"] == "summary"]
    rss = [c["peak_rss_mb"] for c in summary["cells"]]
    assert all(isinstance(x, float) and x > 0 for x in rss)
    with capsys.disabled():
        seconds = ", ".join(f"{s['seconds']:.1f}" for s in steps)
        print(f"\nSmolLM2 gyre up: steps of {seconds} s, wall {summary['wall_s']:.0f} s, "
              f"worker peak RSS {', '.join(str(round(x)) for x in rss)} MB")

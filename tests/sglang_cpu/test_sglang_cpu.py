"""The opt-in tier: gyre's SglangEngine against a real SGLang 0.5.23 on CPU (an unsupported
SGLang setup, used only to check the adapter against the library rather than a fake).

Skipped unless GYRE_TEST_SGLANG_CPU=1. Then build_env.sh builds (once) a ~2.5 GB venv in
${GYRE_CACHE:-~/.cache/gyre}, and _check.py runs there once per session; these tests
assert on its JSON report. Log-probs must equal the CPU trainer's within 1e-4.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
MATCH = 1e-4

pytestmark = [
    pytest.mark.skipif(os.environ.get("GYRE_TEST_SGLANG_CPU") != "1",
                       reason="opt-in: GYRE_TEST_SGLANG_CPU=1 python -m pytest tests/sglang_cpu (builds a ~2.5 GB "
                              "SGLang CPU venv in ${GYRE_CACHE:-~/.cache/gyre} on first use)"),
    # The first test pays for the module fixtures: the venv's build (minutes) and SGLang's run.
    pytest.mark.timeout(4200),
]


def _tail(text: str, n: int = 4000) -> str:
    return text[-n:]


def _rounded(x):
    if isinstance(x, float):
        return float(f"{x:.3g}") if abs(x) < 1e-2 else round(x, 3)
    return {k: _rounded(v) for k, v in x.items()} if isinstance(x, dict) else x


@pytest.fixture(scope="module")
def sglang_python() -> str:
    """The venv's python, built or reused by build_env.sh (the first build downloads from PyPI)."""
    r = subprocess.run(["bash", str(HERE / "build_env.sh")], capture_output=True, text=True, timeout=3000)
    if r.returncode != 0:
        pytest.fail(f"build_env.sh failed ({r.returncode}):\n{_tail(r.stdout + r.stderr)}")
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("READY "), _tail(r.stdout)
    return last.removeprefix("READY ")


@pytest.fixture(scope="module")
def report(sglang_python) -> dict:
    """Runs _check.py once (SGLang's start is ~30 s); every stage's figures, by stage."""
    cmd = [sglang_python, str(HERE / "_check.py")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    if r.returncode != 0:
        pytest.fail(f"_check.py failed ({r.returncode}):\n{_tail(r.stdout)}\n{_tail(r.stderr)}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _generated(stage: dict, version: int) -> None:
    """One batch of generate(): five requests; four run to length or stop, one stops at once."""
    assert stage["diff"] <= MATCH
    assert stage["lps_per_token"] and stage["versions"] == [version]
    stop = [r for r in stage["reasons"] if r.endswith("stop")]
    assert len(stage["reasons"]) == 5 and len(stop) == 1
    assert stage["reasons"][stop[0]] == "stop" and stage["lengths"][stop[0]] == 1
    for rid, reason in stage["reasons"].items():
        assert (reason, stage["lengths"][rid]) == ("length", 16) or (reason == "stop" and stage["lengths"][rid] <= 16)
    assert stage["chunks"] >= 5 and stage["tokens"] == sum(stage["lengths"].values())


def test_generate_logprobs_equal_the_trainers(report):
    assert report["sglang"] == "0.5.23" and report["torch"] == "2.13.0+cpu"
    _generated(report["generate"], version=0)


def test_abort_by_id_leaves_the_others_running(report):
    a = report["abort"]
    assert a["running_before"] == 3 and a["running_after"] == 0
    assert a["abort_output"] == {"rid": "x1", "reason": "abort", "finished": True}
    assert not a["x1_output_after_abort"] and a["abort_again_is_none"]
    assert set(a["reasons"].values()) <= {"stop", "length"} and min(a["lengths"].values()) >= 2
    assert a["diff"] <= MATCH


def test_logprobs_are_at_temperature_one_before_top_p(report):
    assert set(report["sampling"]) == {"t0.7_p0.9", "t1.5", "greedy"}
    assert max(report["sampling"].values()) <= MATCH


def test_role_change_each_way_then_generate(report):
    _generated(report["role_change"], version=0)


def test_publication_from_an_updated_trainer(report):
    u = report["update"]
    assert u["bytes"] >= 6_000_000 and u["grad_norm"] > 0
    _generated(u, version=1)
    assert u["diff_to_old"] > 100 * MATCH  # the engine really serves the new weights


def test_publication_while_released_loads_at_resume(report):
    u = report["update_while_released"]
    assert u["bytes"] >= 6_000_000
    _generated(u, version=2)


def test_publication_with_requests_in_flight(report):
    f = report["update_in_flight"]
    assert f["running_at_update"] >= 2 and f["version"] == 3
    assert set(f["reasons"].values()) <= {"stop", "length"}
    # Each token matches the old or the new weights, old ones first, and new ones follow.
    assert f["neither"] == 0 and f["old_then_new"] and f["new_tokens"] > 0


def test_report_figures(report, capsys):
    """Shown on the terminal whatever the capture: timings and the largest log-prob gaps."""
    stages = ("generate", "abort", "role_change", "update", "update_while_released")
    line = {"max_logprob_diff": {**{s: report[s]["diff"] for s in stages if s in report}, **report["sampling"]},
            "start_s": report["start_s"], "release_s": report["role_change"]["release_s"],
            "resume_s": report["role_change"]["resume_s"], "update_s": report["update"]["update_s"],
            "update_in_flight_s": report["update_in_flight"]["update_s"],
            "tokens_per_s": {s: report[s]["tokens_per_s"] for s in stages if "tokens_per_s" in report.get(s, {})},
            "shutdown_s": report["shutdown_s"]}
    with capsys.disabled():
        print(f"\nSGLang CPU tier: {json.dumps(_rounded(line))}")
    assert 0 < report["start_s"] < 600


def test_the_gpu_check_on_cpu_with_sglang_and_megatron(sglang_python, tmp_path, capsys):
    """tests/gpu/check.py (what tests/gpu/run.sh runs on a GPU) with the real SGLang engine and
    the megatron-core trainer in one real workerd, on CPU: generate, a role change each way,
    a training step and a colocated publication, log-probs equal the trainer's before and after."""
    server = {"device": "cpu", "attention_backend": "torch_native", "sampling_backend": "pytorch",
              "sleep_on_idle": True, "max_total_tokens": 8192, "context_length": 4096}
    out = tmp_path / "summary.json"
    r = subprocess.run([sglang_python, str(ROOT / "tests" / "gpu" / "check.py"), "--engine", "sglang",
                        "--trainer", "megatron", "--offload", "--requests", "4", "--tokens", "32",
                        "--tolerance", str(MATCH), "--server", json.dumps(server), "--work", str(tmp_path / "w"),
                        "--json-out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, _tail(r.stdout) + _tail(r.stderr)
    s = json.loads(out.read_text())
    assert s["ok"] and s["logprob_max_diff_v0"] <= MATCH and s["logprob_max_diff_v1"] <= MATCH
    with capsys.disabled():
        print(f"\nGPU check on CPU (sglang + megatron): {json.dumps(_rounded(s))}")

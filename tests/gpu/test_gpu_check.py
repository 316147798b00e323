"""tests/gpu/check.py on CPU backends (engine cpu, trainer megatron): the GPU check's whole
path runs in CI, so the script cannot rot where no GPU is lent; `tests/gpu/run.sh` itself
runs with GYRE_TEST_GPU=1 on a GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.timeout(300)
def test_check_script_on_cpu_backends(tmp_path):
    pytest.importorskip("megatron.core")
    out = tmp_path / "summary.json"
    r = subprocess.run([sys.executable, str(HERE / "check.py"), "--engine", "cpu", "--trainer", "megatron",
                        "--offload", "--requests", "4", "--tokens", "16", "--tolerance", "1e-4",
                        "--work", str(tmp_path / "work"), "--json-out", str(out)],
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["ok"] and s["failed"] == []
    assert s["logprob_max_diff_v0"] < 1e-4 and s["logprob_max_diff_v1"] < 1e-4  # fp32 on CPU
    assert s["publish_bytes"] > 6_000_000 and s["rollout_tokens_per_s"] > 0
    for key in ("to_training_seconds", "to_rollout_seconds", "train_step_seconds", "publish_seconds"):
        assert s[key] >= 0


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_run_script():
    r = subprocess.run(["bash", str(HERE / "run.sh")], capture_output=True, text=True, timeout=560,
                       env=dict(os.environ))
    print(r.stdout[-5000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-2])["ok"]

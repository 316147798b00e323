"""Rewards that cannot be trained on (issue 26, finding 5, the evaluator's boundary).

A huge finite reward (1e308) used to pass as valid, overflow the group's advantages into
NaN, and crash every resume that restored its group. Now a reward is checked where it comes
in (finite, within the run's reward_range): outside it the execution is evaluator_error,
invalid, never trained, its ref naming the reward and the range; and the advantages of any
finite rewards stay finite. Real evaluator processes and real harness processes.
"""

from __future__ import annotations

import json
import math
import sys

import pytest

from gyre.coordinator.buffer import Execution, Group, advantages
from gyre.coordinator.taskformats import load_harbor_task
from gyre.coordinator.tasks import Task
from gyre.coordinator.waterlevel import ExecState, Tracked
from tests.sandbox.conftest import harbor_task, podman, podman_ready, run_task, scripted_proxy, shell_preset

__all__ = ["podman", "podman_ready", "scripted_proxy"]  # fixtures, used by name


def test_valid_reward_names_what_is_wrong():
    from gyre.coordinator.evaluator import valid_reward

    assert valid_reward(0.5, (-1e6, 1e6)) is None and valid_reward(-1e6, (-1e6, 1e6)) is None
    assert valid_reward(1, (0, 1)) is None
    assert valid_reward(1e308, (-1e6, 1e6)) == "reward 1e+308 is outside reward_range [-1e+06, 1e+06]"
    assert valid_reward(-2.0, (0.0, 1.0)) == "reward -2 is outside reward_range [0, 1]"
    assert valid_reward(math.nan, (0, 1)) == "reward nan is not finite"
    assert valid_reward(math.inf, (0, 1)) == "reward inf is not finite"
    assert valid_reward(True, (0, 1)) == "reward True is not a number"
    assert valid_reward("1", (0, 1)) == "reward '1' is not a number"
    assert valid_reward(None, (0, 1)) == "reward None is not a number"


def _scorer(tmp_path, score: float) -> dict:
    path = tmp_path / "score.py"
    path.write_text(f"import json; print(json.dumps({{'score': {score!r}, 'ref': 'huge'}}))\n")
    return {"type": "command", "argv": [sys.executable, str(path)]}


async def test_a_huge_reward_is_evaluator_error_never_trained(scripted_proxy, tmp_path):
    task = Task(id="huge", prompt="p", evaluator=_scorer(tmp_path, 1e308))
    run = await run_task(scripted_proxy, _process(), task, tmp_path / "run", shell_preset("true"))
    assert (run.status, run.reward, run.valid) == ("evaluator_error", None, False), (run.status, run.reward)
    assert "1e+308 is outside reward_range [-1e+06, 1e+06]" in run.ref, run.ref
    assert run.eval_attempts == 1  # the same state scores the same: not retried


async def test_the_run_configs_reward_range_is_the_boundary(scripted_proxy, tmp_path):
    from gyre.coordinator.config import CoordinatorConfig
    from gyre.coordinator.launcher import launch_spec

    spec = launch_spec(CoordinatorConfig(run_dir=tmp_path, model_dir=tmp_path, reward_range=(0.0, 1.0)))
    assert spec.reward_range == (0.0, 1.0)
    task = Task(id="two", prompt="p", evaluator=_scorer(tmp_path, 2.0))
    run = await run_task(scripted_proxy, _process(), task, tmp_path / "run", shell_preset("true"),
                         reward_range=spec.reward_range)
    assert (run.status, run.reward, run.valid) == ("evaluator_error", None, False)
    assert "reward 2 is outside reward_range [0, 1]" in run.ref, run.ref
    run = await run_task(scripted_proxy, _process(), Task(id="one", prompt="p", evaluator=_scorer(tmp_path, 1.0)),
                         tmp_path / "run2", shell_preset("true"), run_id="e2", reward_range=spec.reward_range)
    assert (run.status, run.reward, run.valid) == ("completed", 1.0, True)  # the range's own ends are in it


@pytest.mark.sandbox
async def test_a_verifiers_huge_reward_is_evaluator_error(podman, scripted_proxy, tmp_path):
    folder = harbor_task(tmp_path, "huge", test_sh="echo 1e308 > /logs/verifier/reward.txt\n")
    run = await run_task(scripted_proxy, podman, load_harbor_task(folder), tmp_path / "run", shell_preset("true"))
    assert (run.status, run.reward, run.valid) == ("evaluator_error", None, False), (run.status, run.reward)
    assert "outside reward_range" in run.ref, run.ref


def _group(rewards: list[float]) -> Group:
    runs = []
    for i, r in enumerate(rewards):
        tracked = Tracked()
        tracked.state = ExecState.CLOSED
        runs.append(Execution(id=f"r{i}", group=0, index=i, task=None, tracked=tracked, version_dispatched=0,
                              reward=r, valid=True))
    return Group(id=0, task=None, version=0, size=len(runs), runs=runs)


def test_advantages_are_finite_for_any_finite_rewards_and_unchanged_for_ordinary_ones():
    for rewards in ([1e308, -1e308, 0.5], [1e308, 1e308, 1e307], [1.7e308, 0.0], [5e-324, 0.0]):
        adv = advantages(_group(rewards))
        assert all(math.isfinite(a) for a in adv.values()), (rewards, adv)
        top = max(range(len(rewards)), key=lambda i: rewards[i])
        assert adv[f"r{top}"] >= max(adv.values()), (rewards, adv)  # the best reward keeps the best advantage
        json.dumps(adv, allow_nan=False)  # what a journal or a resume writes
    # Ordinary rewards: what (r - mean) / (std + 1e-6) gives, to rounding.
    rewards = [0.0, 0.25, 1.0, 0.5]
    mean = sum(rewards) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 4)
    adv = advantages(_group(rewards))
    assert adv == pytest.approx({f"r{i}": (r - mean) / (std + 1e-6) for i, r in enumerate(rewards)}, rel=1e-12)
    assert advantages(_group([0.7, 0.7])) == {"r0": 0.0, "r1": 0.0}


def _process():
    from gyre.coordinator.sandbox.process import ProcessBackend

    return ProcessBackend()


@pytest.mark.timeout(600)
def test_a_journaled_huge_reward_resumes_as_evaluator_error_not_a_crash_loop(tiny_dir, tmp_path):
    """A run journaled before rewards were checked (or an edited journal): its resume used to
    restore the 1e308 every time and crash training it; now it is an evaluator_error."""
    from typer.testing import CliRunner

    from gyre.cli.main import app
    from tests.coordinator.test_resume import kill_at, write_config

    run = tmp_path / "run"
    kill_at(write_config(tmp_path, tiny_dir, steps=2, checkpoint_every=0), run, "step 1/2")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    dispatched = {r: json.loads(x)["group"] for x in lines if '"dispatch"' in x for r in json.loads(x)["runs"]}
    doctored = None
    for i, line in enumerate(lines):
        ev = json.loads(line)
        if ev["event"] == "execution" and ev["valid"] and doctored is None:
            ev["reward"], doctored = 1e308, ev["id"]
            lines[i] = json.dumps(ev)
    assert doctored is not None
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    r = CliRunner().invoke(app, ["up", "--resume", str(run), "--no-live"])
    assert r.exit_code == 0, r.output
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"event":"step"' in x]
    assert all(math.isfinite(s["loss"]) for s in steps) and steps[-1]["step"] == 2
    resumed = steps[-2:]  # no checkpoint: the resumed run trains steps 1 and 2 again, the doctored group among them
    assert dispatched[doctored] in {g for s in resumed for g in s["group_ids"]}
    assert all(s["reward_mean"] is None or 0.0 <= s["reward_mean"] <= 1.0 for s in resumed)  # 1e308 never counted

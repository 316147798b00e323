"""Held-out evaluation: the pass@k estimator, what counts as a sample, the scheduler giving
evaluations only the slots training leaves (and every cell once training is over), and a
real run evaluating the base model and each step's, never training on it."""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from gyre.cli.main import app
from gyre.coordinator.heldout import pass_at_k, score
from gyre.coordinator.schedule import State, decide


@given(st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_the_chance_that_k_drawn_samples_hold_a_pass(args):
    n, c, k = args
    draws = list(itertools.combinations([True] * c + [False] * (n - c), k))
    assert math.isclose(pass_at_k(n, c, k), sum(any(d) for d in draws) / len(draws))


def test_invalid_outcomes_are_not_samples_and_a_task_without_any_is_unscored_not_failed():
    out = score({"a": [(True, 1.0), (False, None), (True, 0.0)], "b": [(False, None)], "c": [(True, 0.5)]},
                k=2, threshold=0.5)
    assert out["per_task"]["a"] == {"samples": 2, "passed": 1, "rewards": [1.0, 0.0]}
    assert out["unscored"] == ["b"] and out["scored_tasks"] == 2
    assert out["pass_at_k"] == pytest.approx((1.0 + 1.0) / 2)  # c: pass@1 of its one sample, a: 1 of 2 drawn both
    assert out["pass_at_1"] == pytest.approx((0.5 + 1.0) / 2)
    assert score({"b": [(False, None)]}, k=1, threshold=1.0)["pass_at_k"] is None  # unknown, never 0


def state(**kw) -> State:
    base = dict(policy="elastic", roles=("rollout", "rollout"), capacity=(4, 4), queued=0, running=0, ready_groups=0,
                groups_per_step=2, mu=1, steps=3, steps_done=1, steps_in_burst=0)
    return State(**{**base, **kw})


def test_evaluations_take_only_the_slots_training_leaves():
    assert decide(state(queued=3, running=2, eval_queued=10)).launch_eval == 8 - 2 - 3
    d = decide(state(queued=10, running=0, eval_queued=10, eval_running=2))
    assert d.launch == 6 and d.launch_eval == 0  # running evaluations hold their slots; training comes first


def test_after_the_last_step_every_cell_serves_the_evaluations_and_the_run_waits_for_them():
    s = state(roles=("training", "training"), steps_done=3, eval_queued=4)
    d = decide(s)
    assert set(d.switches) == {(0, "rollout"), (1, "rollout")} and not d.done
    assert decide(state(steps_done=3, eval_queued=4)).launch_eval == 4
    assert not decide(state(steps_done=3, eval_running=1)).done and decide(state(steps_done=3)).done


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_evaluates_the_base_model_and_every_step_and_never_trains_on_it(tiny_dir, tmp_path):
    here = Path(__file__).parent
    evaluator = {"type": "command", "argv": [sys.executable, str(here / "_evaluator.py"), "ok"]}
    tasks, held = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    tasks.write_text("\n".join(json.dumps({"id": f"t{i}", "prompt": f"mode:normal task {i}", "evaluator": evaluator})
                               for i in range(3)))
    held.write_text("\n".join(json.dumps({"id": f"h{i}", "prompt": f"mode:normal held {i}", "evaluator": evaluator})
                              for i in range(2)))
    cfg = tmp_path / "run.toml"
    harness = json.dumps([sys.executable, str(here / "_harness.py")])
    cfg.write_text(f'steps = 2\ngroups_per_step = 1\ngroup_size = 2\nharness = {harness}\n'
                   f'tasks_path = "{tasks}"\nmodel_dir = "{tiny_dir}"\ndefault_max_tokens = 8\neval_every = 1\n'
                   f'eval_tasks_path = "{held}"\neval_k = 2\neval_pass_threshold = 0.5\nworkers = "inproc"\n')
    run = tmp_path / "run"
    r = CliRunner().invoke(app, ["up", str(cfg), "--run-dir", str(run), "--no-live"])
    assert r.exit_code == 0, r.output
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    # The base model, then each step's with the version its publication just made (one per step:
    # mu = 1). A step whose groups all scored alike trains nothing and publishes its version again
    # (the tiny model's two 8-token answers can coincide): the round still evaluates what is served.
    published = [e["version"] for e in events if e["event"] == "publish"]
    assert len(published) == 2 and published[-1] >= 1, published  # something trained: the last round is after it
    assert [(e["step"], e["version"]) for e in evals] == [(0, 0), (1, published[0]), (2, published[1])]
    for e in evals:
        assert e["complete"] and e["tasks"] == 2 and e["executions"] == 4 and e["k"] == 2
        assert e["seconds"] > 0  # the round's wall time (trackers' timing_s/eval)
        scored = [x for x in events if x["event"] == "execution" and x.get("eval") == e["round"]]
        assert len(scored) == 4 and {x["task"] for x in scored} == {"h0", "h1"}
        # the estimator over exactly the rewards the executions got
        per = {t: [(x["valid"], x["reward"]) for x in scored if x["task"] == t] for t in ("h0", "h1")}
        assert e["pass_at_k"] == score(per, 2, 0.5)["pass_at_k"]
    trained = {g for e in events if e["event"] == "step" for g in e["group_ids"]}
    dispatched = {e["group"] for e in events if e["event"] == "dispatch"}
    assert trained <= dispatched and all(e["task"].startswith("t") for e in events if e["event"] == "dispatch")
    (summary,) = [e for e in events if e["event"] == "summary"]
    training_runs = [e for e in events if e["event"] == "execution" and e.get("eval") is None]
    assert summary["counters"]["f"] == len(training_runs)  # the waterlevel never saw an evaluation


def test_a_resumed_run_numbers_its_rounds_after_the_ones_its_directory_holds(tmp_path):
    from gyre.coordinator.heldout import HeldOut, rounds_in
    from gyre.coordinator.tasks import Task

    assert rounds_in(tmp_path) == 0
    for name in ("eval000-000-00", "eval002-001-01", "g00001-00"):
        (tmp_path / "executions" / name).mkdir(parents=True)
    assert rounds_in(tmp_path) == 3
    held = HeldOut([Task(id="h", prompt="p")], k=2, threshold=1.0, first_round=rounds_in(tmp_path))
    r = held.dispatch(step=4, version=4)
    assert [x.id for x in r.runs] == ["eval003-000-00", "eval003-000-01"] and held.round_of(r.runs[1]) is r

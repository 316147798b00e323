"""The coordinator end to end on real worker daemons, a real proxy and real harness
processes: every execution ends in one status, each counted once, and only valid
outcomes reach training."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from gyre.coordinator import resume
from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.main import Coordinator
from tests.coordinator.scripted import write_tasks
from tests.inproc import coordinator

HERE = Path(__file__).parent
EVAL = [sys.executable, str(HERE / "_evaluator.py")]


def tasks_file(tmp_path: Path) -> Path:
    tasks = [
        {"id": "normal", "prompt": "mode:normal say hi", "evaluator": {"type": "command", "argv": EVAL + ["ok"]}},
        {"id": "sleep", "prompt": "mode:sleep say hi", "timeout_s": 8,
         "evaluator": {"type": "command", "argv": EVAL + ["ok"]}},
        {"id": "crash", "prompt": "mode:crash", "evaluator": {"type": "command", "argv": EVAL + ["ok"]}},
        {"id": "flaky", "prompt": "mode:normal flaky", "evaluator": {"type": "command", "argv": EVAL + ["flaky"]}},
        {"id": "broken", "prompt": "mode:normal broken", "evaluator": {"type": "command", "argv": EVAL + ["broken"]}},
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(t) for t in tasks))
    return path


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", ["inproc", "local"])  # the file's zmq twin
async def test_statuses_rewards_and_validity(tiny_dir, tmp_path, workers):
    cfg = CoordinatorConfig(run_dir=tmp_path / "run", model_dir=tiny_dir, steps=1, policy="async", cells=2,
                            groups_per_step=5, group_size=2, min_valid=1, phi=0, mu=1,
                            harness=(sys.executable, str(HERE / "_harness.py")), tasks_path=tasks_file(tmp_path),
                            eval_attempts=3, eval_budget_s=60, seed=1)
    seen: list[dict] = []
    build = coordinator if workers == "inproc" else Coordinator
    coord = build(cfg, on_step=lambda rep: seen.append(json.loads(json.dumps(coord.status()))))
    reports = await coord.run()
    assert len(reports) == 1
    # The live view's data at the step, as `gyre top` gets it (plain JSON, no key in it).
    (status,) = seen
    assert status["steps"] == {"done": 1, "target": 1} and status["policy"] == "async"
    assert status["last_step"]["step"] == 1 and status["version"] == 0 and status["trainer_version"] == 1
    assert [c["role"] for c in status["cells"]] == ["training", "rollout"]
    wl = status["waterlevel"]
    assert wl["d"] == wl["queued"] + wl["running"] + wl["finished"] and wl["finished"] >= 5
    info = json.loads((cfg.run_dir / "coordinator.json").read_text())
    assert info["status_url"].endswith("/gyre/status") and "gyre-" not in json.dumps(status)
    # Each execution's home is shown; cell 0 trains, so every home is on the rollout cell.
    assert status["loop_lag_ms"]["samples"] > 0  # the event loop's lateness, measured while it ran
    assert status["gc"]["freeze_every_s"] == 30.0 and status["gc"]["freezes"] >= 1  # start-up's, at least
    routing = status["routing"]
    assert routing["policy"] == "affine" and set(routing["homes"].values()) <= {status["cells"][1]["node"]}
    assert routing["decisions"].get("placed", 0) >= 1 and status["cells"][1]["homes"] == len(routing["homes"])
    lines = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    execs = [x for x in lines if x["event"] == "execution"]
    by_task: dict[str, list[dict]] = {}
    for e in execs:
        by_task.setdefault(coord.buffer.groups[e["group"]].task.id, []).append(e)
    # Each launched execution is counted exactly once, whatever its end.
    assert len({e["id"] for e in execs}) == len(execs) == coord.wl.c.f == coord.wl.c.p
    for e in by_task["normal"]:
        assert e["status"] == "completed" and e["valid"] and 0 <= e["reward"] <= 1
    for e in by_task["sleep"]:  # stopped at the deadline, scored on its preserved answer
        assert e["status"] == "timed_out" and e["valid"] and e["reward"] is not None
    for e in by_task["crash"]:  # nothing assessable: a valid zero placeholder
        assert e["status"] == "placeholder" and e["valid"] and e["reward"] == 0.0
    for e in by_task["flaky"]:  # failed twice against the same state, then scored
        assert e["status"] == "completed" and e["valid"] and e["eval_attempts"] == 3
    for e in by_task["broken"]:  # never a zero: invalid, excluded
        assert e["status"] == "evaluator_error" and not e["valid"] and e["reward"] is None
    (step,) = [x for x in lines if x["event"] == "step"]
    broken_groups = {e["group"] for e in by_task["broken"]}
    assert not broken_groups & set(step["group_ids"])  # invalid outcomes never reach training
    assert step["version"] == 1 and step["staleness_mean"] == 0 and step["groups"] == 5
    assert {x["version"] for x in lines if x["event"] == "publish"} == {1}
    assert json.loads((cfg.run_dir / "config.json").read_text())["policy"] == "async"


@pytest.mark.timeout(300)
async def test_elastic_run_keeps_its_promises(tiny_dir, tmp_path):
    """Elastic on real workers: the core trains first, a satellite may join mid-batch, the
    burst publishes once, and every execution is counted exactly once."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", 4)
    cfg = CoordinatorConfig(run_dir=tmp_path / "run", model_dir=tiny_dir, steps=2, policy="elastic", cells=2,
                            groups_per_step=2, group_size=2, min_valid=1, phi=0, mu=2, exec_slots_per_cell=4,
                            harness=(sys.executable, str(HERE / "_harness.py")), tasks_path=tasks, seed=3)
    coord = coordinator(cfg)
    reports = await coord.run()
    assert [r.version for r in reports] == [1, 2]
    lines = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    roles = [x for x in lines if x["event"] == "role"]
    first_training = next(x for x in roles if x["to"] == "training")
    assert first_training["cell"] == 0  # the core moves first
    assert [x["version"] for x in lines if x["event"] == "publish"] == [2]  # one burst of mu=2 steps
    execs = [x for x in lines if x["event"] == "execution"]
    assert len({e["id"] for e in execs}) == len(execs) == coord.wl.c.f == coord.wl.c.p
    assert all(r.cells_training in (1, 2) for r in reports)
    assert [r.staleness_mean for r in reports] == [0.0, 1.0]  # phi + (mu-1)/2 = 0.5 on average
    # What a comparison of runs reads: the session's clock and start-up, each step's micro-steps
    # by the cells that claimed them, and when its training began.
    assert [x["event"] for x in lines][:2] == ["start", "ready"]
    start, ready = lines[0], lines[1]
    assert not start["resumed"] and 0 < ready["startup_s"] <= ready["t"] + 1e-3
    for e in execs:  # calls.jsonl's wall-clock stamps, less t0_wall, fall inside their execution
        text = (cfg.run_dir / "executions" / e["id"] / "calls.jsonl").read_text()
        calls = [json.loads(x) for x in text.split("\n") if x]  # (a model's text may hold U+2028)
        assert calls and all(e["t_start"] - 0.5 <= c["t_start"] - start["t0_wall"] <= e["t_end"] + 0.5
                             for c in calls), (e, calls[0]["t_start"] - start["t0_wall"])
    for step in (x for x in lines if x["event"] == "step"):
        assert len(step["micro_steps_by_cell"]) == 2 and step["micro_steps_by_cell"][0] > 0
        assert step["micro_steps"] == sum(step["micro_steps_by_cell"]) > 0
        assert 0 <= step["training_started_s"] <= step["seconds"]


@pytest.mark.timeout(300)
async def test_colocate_switches_its_cells_in_parallel(tiny_dir, tmp_path):
    """Colocate moves the whole pool at once: each cell's switch is its own task, so the
    switches of one transition overlap in time (one after another they would not), and
    each keeps its own seconds in metrics.jsonl; every training cell gets micro-steps."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", 3)
    cfg = CoordinatorConfig(run_dir=tmp_path / "run", model_dir=tiny_dir, steps=1, policy="colocate", cells=3,
                            groups_per_step=2, group_size=2, min_valid=1, phi=0, mu=1, exec_slots_per_cell=2,
                            harness=(sys.executable, str(HERE / "_harness.py")), tasks_path=tasks, seed=3)
    reports = await coordinator(cfg).run()
    assert len(reports) == 1 and reports[0].cells_training == 3
    lines = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    to_training = [x for x in lines if x["event"] == "role" and x["to"] == "training"]
    assert sorted(x["cell"] for x in to_training) == [0, 1, 2]
    assert all(x["seconds"] > 0 for x in to_training)
    starts = [x["t"] - x["seconds"] for x in to_training]
    ends = [x["t"] for x in to_training]
    assert max(starts) < min(ends)  # all three were under way at once
    # Two groups, three training cells: each group is cut into two micro-steps, so no cell
    # holds the training role with nothing to claim ([1, 1, 0] when a group was one).
    (step,) = [x for x in lines if x["event"] == "step"]
    assert len(step["group_ids"]) == 2 and all(n > 0 for n in step["micro_steps_by_cell"]), step


@pytest.mark.timeout(300)
async def test_a_run_on_tensor_parallel_megatron_cells(tiny_dir, tmp_path):
    """`trainer_backend = "megatron"` with TP=2 cells under colocate (both cells train each
    step, so rank r of each cell reduces with its peer): each spawned workerd trains with
    megatron-core (on CPU, behind the shim) as rank 0 of its cell with a child rank 1, offloads
    it for rollouts and onloads it for training, and the run's publications reach the engines.
    The same loop as on the CPU trainer, nothing else changed."""
    pytest.importorskip("megatron.core")
    cfg = CoordinatorConfig(run_dir=tmp_path / "run", model_dir=tiny_dir, steps=1, policy="colocate", cells=2,
                            groups_per_step=1, group_size=4, phi=0, mu=1, exec_slots_per_cell=4, seed=3,
                            trainer_backend="megatron", trainer_options={"offload": True, "tp": 2})  # the demo harness
    coord = Coordinator(cfg)
    reports = await coord.run()
    assert [r.version for r in reports] == [1]
    registered = [e for e in coord.cluster.events if type(e).__name__ == "Register"]
    assert {e.backends["trainer"] for e in registered} == {"megatron"}
    lines = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    roles = [x for x in lines if x["event"] == "role"]
    assert {x["to"] for x in roles} == {"training", "rollout"}  # both directions, offload and onload
    assert [x["version"] for x in lines if x["event"] == "publish"] == [1]
    assert all(r.loss == r.loss and r.tokens_trained > 0 for r in reports)  # finite, trained on something
    # Both cells trained together: each TP rank reduced with its peer in the other cell.
    assert [r.cells_training for r in reports] == [2]
    execs = [x for x in lines if x["event"] == "execution"]
    assert len({e["id"] for e in execs}) == len(execs) == coord.wl.c.f == coord.wl.c.p


@pytest.mark.timeout(300)
async def test_an_elastic_run_on_pipeline_parallel_megatron_trainers(tiny_dir, tmp_path):
    """Elastic on PP=2 megatron cells with offload: the core trains first while the other
    cell serves, publications reach an offloaded trainer (each stage keeps its part on the
    host until onload), and the step after a publication trains on rollouts of the
    published weights, gathered from both stages."""
    pytest.importorskip("megatron.core")
    cfg = CoordinatorConfig(run_dir=tmp_path / "run", model_dir=tiny_dir, steps=2, policy="elastic", cells=2,
                            groups_per_step=2, group_size=3, phi=0, mu=1, exec_slots_per_cell=4, seed=3,
                            trainer_backend="megatron", trainer_options={"offload": True, "pp": 2},
                            checkpoint_every=2)
    coord = Coordinator(cfg)
    reports = await coord.run()
    assert [r.version for r in reports] == [1, 2]
    lines = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines if x["event"] == "publish"] == [1, 2]
    steps = [x for x in lines if x["event"] == "step"]
    # Steps that trained on fresh rollouts: engines served what the trainer published.
    fresh = [s for s in steps if s["tokens_trained"] and not any(s["staleness"])]
    assert fresh and all(abs(s["mismatch"]) < 1e-3 for s in fresh)
    assert any(s["version"] == 2 for s in fresh)  # the step after the first publication
    # The core's checkpoint: a file per rank, rank 0's the one a resume looks for; the run,
    # extended by a step, resumes from it on fresh PP cells (each rank loads its own file,
    # into an offloaded trainer) and trains on (a finished run used to wait for groups forever).
    folder, state = resume.latest(cfg.run_dir)
    assert sorted(p.name for p in folder.glob("trainer.pt*")) == ["trainer.pt", "trainer.pt.pp1.tp0"]
    again = await Coordinator(dataclasses.replace(cfg, steps=3), resume=True).run()
    assert [r.version for r in again] == [3]
    lines = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    (res,) = [x for x in lines if x["event"] == "resume"]
    assert res["step"] == 2

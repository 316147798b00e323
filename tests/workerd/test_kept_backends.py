"""A workerd across its coordinator's restart (issue 34): asked to register again, it keeps its
engine and trainer (a step's accumulated gradients dropped) and says so in its Register; the
next Welcome takes them only for the same run, model and specs, its trainer at the version the
resume starts from. Anything else builds them again, as every Reregister did before."""

from __future__ import annotations

import itertools

import torch

from gyre.workerd import wire


def _worker():
    from gyre.workerd.config import WorkerConfig
    from gyre.workerd.worker import Worker

    return Worker(WorkerConfig(coordinator="ipc://unused", node_id="n0"))


def test_a_reregistered_worker_keeps_its_backends_for_the_same_run_at_its_trainers_version(tiny_dir):
    worker = _worker()
    ids = itertools.count(1)

    def welcome(**kw) -> wire.Ready:
        fields = {"node_id": "n0", "cell": 0, "role": "training", "model_dir": str(tiny_dir), **kw}
        (ready,) = [m for m, _ in worker.handle(wire.Welcome(req_id=next(ids), **fields), [])]
        assert isinstance(ready, wire.Ready), ready
        return ready

    try:
        first = welcome(run="r1")
        assert not first.kept and first.trainer_version == 0 and worker.kept_state() is None
        trainer, engine = worker.trainer, worker.engine
        for p in trainer.model.parameters():  # a step's gradients, accumulated and never applied
            p.grad = torch.ones_like(p)
        trainer.micro_steps = 3
        worker.handle(wire.Reregister(reason="new session"), [])
        assert worker.kept_state() == {"run": "r1", "cell": 0, "version": 0, "trainer_version": 0}
        assert all(p.grad is None for p in trainer.model.parameters()) and trainer.micro_steps == 0

        again = welcome(run="r1", version=0, role="rollout")
        assert again.kept and (again.role, again.version, again.trainer_version) == ("rollout", 0, 0)
        assert worker.trainer is trainer and worker.engine is engine  # nothing built
        assert again.params == first.params

        for other, why in [({"run": "r2", "version": 0}, "another run"), ({"run": "r1", "version": 1}, "ahead"),
                           ({"run": "r1"}, "a new run's welcome (no version)"),
                           ({"run": "r1", "version": 0, "trainer": wire.TrainerSpec(lr=1e-3)}, "other specs")]:
            worker.handle(wire.Reregister(reason="new session"), [])
            assert worker.kept_state() is not None, why
            built = welcome(**other)
            assert not built.kept and worker.trainer is not trainer, why
            trainer = worker.trainer
            if other.get("run") == "r2":  # what it keeps now is r2's
                worker.handle(wire.Reregister(reason="new session"), [])
                assert worker.kept_state()["run"] == "r2"
                welcome(run="r1")

        worker.handle(wire.Reregister(reason="new session"), [])  # a run-less welcome keeps nothing
        welcome()
        worker.handle(wire.Reregister(reason="new session"), [])
        assert worker.kept_state() is None and worker.trainer is None and worker.engine is None
    finally:
        worker.reset()

"""backends.py: builds a node's rollout engine and trainer from a model directory.

The one place that maps backend names to classes, so worker.py never imports a heavy
library it does not use. Engines: cpu (sglang named, not built yet); trainers: cpu
(megatron named, not built yet). Selecting a GPU backend says which package it needs.
"""

from __future__ import annotations

from typing import Any

from gyre.workerd.wire import GyreError


class BackendError(GyreError):
    """An unknown backend, or one whose package is not installed."""


ENGINES = {"cpu": None, "sglang": ("sglang", "sglang>=0.5.23")}
TRAINERS = {"cpu": None, "megatron": ("megatron.core", "megatron-core>=0.16.1")}
BUILT = {"cpu"}  # backends this build can construct


def check_backends(engine: str, trainer: str) -> None:
    """Unknown names, missing packages and not-yet-built adapters are errors that say which."""
    import importlib.util

    for kind, name, table in (("engine", engine, ENGINES), ("trainer", trainer, TRAINERS)):
        if name not in table:
            raise BackendError(f"unknown {kind} backend {name!r} (known: {', '.join(table)})")
        need = table[name]
        if need is not None and importlib.util.find_spec(need[0].split(".")[0]) is None:
            raise BackendError(f"{kind} backend {name!r} needs {need[1]}: pip install 'gyre[gpu]'")
        if name not in BUILT:
            raise BackendError(f"{kind} backend {name!r}: its adapter is not built yet (this build runs: "
                               f"{', '.join(sorted(BUILT))})")


def build_backends(model_dir: str, *, engine: str, trainer: str,
                   engine_options: dict[str, Any], trainer_options: dict[str, Any]):
    """Returns (engine, trainer, parameter count). Engine and trainer hold separate copies
    of the weights, as SGLang and Megatron do on a GPU node."""
    check_backends(engine, trainer)
    import torch

    from gyre.workerd.engines.cpu import CpuEngine
    from gyre.workerd.model import load_model, num_params
    from gyre.workerd.modeldir import load_config
    from gyre.workerd.trainers.cpu import CpuTrainer

    torch.set_num_threads(int(engine_options.get("threads", torch.get_num_threads())))
    config = load_config(model_dir)
    rollout_model = load_model(model_dir, config)
    train_model = load_model(model_dir, config)
    version = int(engine_options.get("version", 0))
    eng = CpuEngine(rollout_model, version=version, max_running=int(engine_options.get("max_running", 64)),
                    seed=int(engine_options.get("seed", 0)))
    tr = CpuTrainer(train_model, lr=float(trainer_options.get("lr", 1e-5)),
                    weight_decay=float(trainer_options.get("weight_decay", 0.01)),
                    grad_clip=float(trainer_options.get("grad_clip", 1.0)), version=version)
    return eng, tr, num_params(train_model)

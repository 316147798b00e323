"""backends.py: builds a node's rollout engine and trainer from a model directory.

The one place that maps backend names to classes, so worker.py never imports a heavy
library it does not use. Engines: cpu, sglang; trainers: cpu, megatron. Selecting a
backend whose package is missing says which package to install.

Options come from the coordinator's Welcome: its `engine` (wire.EngineSpec: threads, seed,
max_running, version, prefix_cache_mb, the CPU engine's cache of finished requests' KV,
0 turns it off; SGLang keeps its own radix cache) and `trainer` (wire.TrainerSpec: lr,
weight_decay, grad_clip, temperature, the rollout temperature, for trainers compute
log-probs of the distribution engines sample; checkpoint_layers, the CPU trainer recomputing
each layer's activations in the backward pass, when unset as soon as a micro-step's
activations would pass ~2 GiB; micro_step_tokens), their defaults written there once. The
GPU backends take theirs from the specs' `options` (sglang: `server` = SGLang ServerArgs
fields such as tp_size, mem_fraction_static; megatron: tp and pp (a cell of tp x pp ranks,
ranks 1.. as child processes, trainers/tp.py), microbatches (pipeline chunks per
micro-step), offload).
"""

from __future__ import annotations

import os

# BackendError lives in wire/, below the engines that raise it too (engines/sglang.py's
# options); it stays importable from here.
from gyre.workerd.wire import ENGINE_BACKENDS, TRAINER_BACKENDS, BackendError, EngineSpec, TrainerSpec

ENGINES = {"cpu": None, "sglang": ("sglang", "sglang>=0.5.23")}
TRAINERS = {"cpu": None, "megatron": ("megatron.core", "megatron-core>=0.16.1")}
# The names are the wire's (wire.ENGINE_BACKENDS / TRAINER_BACKENDS: the coordinator checks a run's
# config against them without importing this module); these tables say what each name needs.
if tuple(ENGINES) != ENGINE_BACKENDS or tuple(TRAINERS) != TRAINER_BACKENDS:
    raise RuntimeError(f"backends.py's tables ({', '.join(ENGINES)}; {', '.join(TRAINERS)}) differ from wire's "
                      f"names ({', '.join(ENGINE_BACKENDS)}; {', '.join(TRAINER_BACKENDS)})")


def check_backends(engine: str, trainer: str) -> None:
    """Unknown names and missing packages are errors that say which."""
    import importlib.util

    for kind, name, table in (("engine", engine, ENGINES), ("trainer", trainer, TRAINERS)):
        if name not in table:
            raise BackendError(f"unknown {kind} backend {name!r} (known: {', '.join(table)})")
        need = table[name]
        if need is not None and importlib.util.find_spec(need[0].split(".")[0]) is None:
            raise BackendError(f"{kind} backend {name!r} needs {need[1]}: pip install 'gyre[gpu]'")


ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN_PER_LAYER = 80  # float32, measured: 11.6 GiB for SmolLM2 at 8,192 tokens
RECOMPUTE_ABOVE = 2 << 30


def checkpoint_layers(config, spec: TrainerSpec) -> bool:
    """The CPU trainer's activation recomputation: as asked, else on when a full micro-step
    (`micro_step_tokens`) would hold more than ~2 GiB of activations (SmolLM2-135M at 8,192
    tokens: 11.6 GiB without, 3.8 GiB with; the tiny model: 0.5)."""
    if spec.checkpoint_layers is not None:
        return spec.checkpoint_layers
    estimate = (spec.micro_step_tokens * config.hidden_size * config.num_hidden_layers
                * ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN_PER_LAYER)
    return estimate > RECOMPUTE_ABOVE


def build_backends(model_dir: str, *, engine: str, trainer: str, engine_spec: EngineSpec,
                   trainer_spec: TrainerSpec):
    """Returns (engine, trainer, parameter count), the engine's memory released (the worker
    resumes it for a rollout cell). Engine and trainer hold separate copies of the weights,
    as SGLang and Megatron do on a GPU node."""
    check_backends(engine, trainer)
    import torch

    from gyre.workerd.modeldir import load_config

    if engine_spec.threads is not None:
        torch.set_num_threads(engine_spec.threads)
    config = load_config(model_dir)
    version, seed, max_running = engine_spec.version, engine_spec.seed, engine_spec.max_running
    if engine == "sglang":
        from gyre.workerd.engines.sglang import SglangEngine
        from gyre.workerd.weightfiles import weight_files

        server = dict(engine_spec.options.get("server", {}))
        if server.get("load_format") != "dummy":
            weight_files(model_dir)  # a missing shard is our error, naming the path, before SGLang starts
        # The directory is the whole model spec: SGLang and transformers never reach for a hub.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        eng = SglangEngine(model_dir, version=version, max_running=max_running, seed=seed,
                           options=server)
    else:
        from gyre.workerd.engines.cpu import CpuEngine
        from gyre.workerd.model import load_model

        eng = CpuEngine(load_model(model_dir, config), version=version, max_running=max_running, seed=seed,
                        prefix_cache_bytes=engine_spec.prefix_cache_mb << 20)
    eng.release_memory()  # the giving side frees first: the trainer is built into free memory
    common = dict(lr=trainer_spec.lr, weight_decay=trainer_spec.weight_decay, grad_clip=trainer_spec.grad_clip,
                  version=version, temperature=trainer_spec.temperature)
    if trainer == "megatron":
        from gyre.workerd.trainers.megatron import MegatronTrainer

        own = trainer_spec.options
        offload = own.get("offload")
        tp, pp = int(own.get("tp", 1)), int(own.get("pp", 1))
        options = dict(seed=seed, offload=None if offload is None else bool(offload), **common)
        if own.get("microbatches") is not None:
            options["microbatches"] = int(own["microbatches"])
        if tp * pp > 1:  # ranks 1.. in child processes of this workerd
            from gyre.workerd.trainers.tp import TensorParallelTrainer

            tr = TensorParallelTrainer(model_dir, config, tp=tp, pp=pp, **options)
        else:
            tr = MegatronTrainer(model_dir, config, tp=tp, pp=pp, **options)  # bad sizes refused there
        params = tr.num_params
    else:
        from gyre.workerd.model import load_model, num_params
        from gyre.workerd.trainers.cpu import CpuTrainer

        model = load_model(model_dir, config)
        tr = CpuTrainer(model, checkpoint_layers=checkpoint_layers(config, trainer_spec), **common)
        params = num_params(model)
    return eng, tr, params
